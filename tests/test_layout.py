"""The dependency rules of DESIGN.md, read from the source: imports run one way, config.py is a
leaf, nothing but tests imports sample.py, and train.py stays one readable file."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def our_modules() -> dict[str, str]:
    """Module name -> path of every Python file of ours outside tests/ and .venv."""
    modules = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs
                   if not d.startswith(".") and d not in ("tests", "__pycache__", "runs", "outputs", "data")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                modules[module] = path
    return modules


MODULES = our_modules()


def imports_of(path: str) -> set[str]:
    """Our modules that the file at `path` imports (by top-level name or full dotted name)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in MODULES}
    return found


def test_the_module_list_is_real():
    assert {"train", "seqax.config", "seqax.attention", "sample", "seqax.runs", "seqax.shardlib.shardops",
            "tools.export_hf"} <= set(MODULES)


def test_config_imports_no_module_of_ours():
    assert imports_of(MODULES["seqax.config"]) == set()


def test_what_train_imports_does_not_import_train():
    """The libraries under train.py (and what they import in turn) never reach back up to it."""
    seen, todo = set(), sorted(imports_of(MODULES["train"]))
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        assert "train" not in imports_of(MODULES[module]), f"{module} imports train"
        todo += sorted(imports_of(MODULES[module]))
    assert "sample" not in seen


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "sample"))
def test_nothing_but_tests_imports_sample(module):
    assert "sample" not in imports_of(MODULES[module])


def test_one_module_defines_the_attention_kernels_and_their_specification():
    defined = {}
    for module, path in MODULES.items():
        for node in ast.parse(open(path).read()).body:
            if (isinstance(node, ast.FunctionDef)
                    and node.name in ("dense_attention", "ring_attention", "causal_document_mask")):
                defined.setdefault(node.name, []).append(module)
    assert defined == {"dense_attention": ["seqax.attention"], "ring_attention": ["seqax.attention"],
                       "causal_document_mask": ["seqax.attention"]}


def test_train_py_is_at_most_500_lines():
    assert sum(1 for _ in open(MODULES["train"])) <= 500


def test_train_py_is_at_most_120_columns():
    """The 500 lines are not met with wide lines (ruff's E501 checks every file; this names the line)."""
    wide = [(number, len(line.rstrip("\n"))) for number, line in enumerate(open(MODULES["train"]), start=1)
            if len(line.rstrip("\n")) > 120]
    assert not wide, f"train.py lines over 120 columns (line, width): {wide}"
