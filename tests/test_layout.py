"""The layout's rules, read from the source: the machinery is the `seqax` package, train.py and
sample.py sit at the root; imports run one way (config.py imports nothing of ours, the package never
imports train.py, sample.py, tools or bench, and its modules import each other without a cycle);
nothing but tests imports sample.py; nothing edits sys.path; train.py stays one readable file
(docs/design.md)."""

import ast
import io
import os
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def our_modules(*, tests: bool = False) -> dict[str, str]:
    """Module name -> path of every Python file of ours (outside tests/ unless `tests`, and .venv*)."""
    modules = {}
    for folder, dirs, files in os.walk(ROOT):
        at_root = folder == ROOT  # runs/, outputs/ and data/ (a run's files, the ladder's datasets) sit there
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                   and not (at_root and d in ("runs", "outputs", "data")) and (tests or d != "tests")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                modules[module] = path
    return modules


MODULES = our_modules()
PACKAGE = sorted(m for m in MODULES if m == "seqax" or m.startswith("seqax."))


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


def lines_of_code(path: str) -> int:
    """Lines of code as cloc counts them: lines holding a token that is neither a comment nor part
    of a docstring (blank, comment-only and docstring lines do not count)."""
    source = open(path).read()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            code.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(code)


def test_the_module_list_is_real():
    assert {"train", "sample", "seqax.config", "seqax.kernels.attention", "seqax.runs", "seqax.shardlib.shardops",
            "tools.export_hf", "bench.measure_step"} <= set(MODULES)
    assert not any(os.path.exists(os.path.join(ROOT, f"{name}.py")) for name in ("config", "memory", "runs"))


def test_config_imports_no_module_of_ours():
    assert imports_of(MODULES["seqax.config"]) == set()


@pytest.mark.parametrize("module", PACKAGE)
def test_the_package_imports_nothing_above_it(module):
    """The machinery sits below train.py: nothing in it reaches up to train.py, sample.py, tools or bench."""
    above = {m for m in imports_of(MODULES[module]) if not m.startswith("seqax")}
    assert not above, f"{module} imports {sorted(above)}"


def test_the_package_has_no_import_cycle():
    graph = {m: {i if i in PACKAGE else i.rsplit(".", 1)[0] for i in imports_of(MODULES[m])} & set(PACKAGE)
             for m in PACKAGE}
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module] - {module}):
            visit(imported)
        path.pop()
        done.add(module)

    for module in PACKAGE:
        visit(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "sample"))
def test_nothing_but_tests_imports_sample(module):
    assert "sample" not in imports_of(MODULES[module])


@pytest.mark.parametrize("module", sorted(our_modules(tests=True)))
def test_nothing_edits_sys_path(module):
    """The package is installed in the venv (pip install -e .): no file of ours edits the import path."""
    for node in ast.walk(ast.parse(open(our_modules(tests=True)[module]).read())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            assert not (node.value.attr == "path" and getattr(node.value.value, "id", None) == "sys"
                        and node.attr in ("insert", "append", "extend", "remove")), f"{module} edits sys.path"


def test_one_module_defines_the_attention_kernels_and_their_specification():
    """The specification, the readable kernel and the blockwise one in attention.py; the Pallas
    kernels' ring in flash_attention.py; each defined once."""
    where = {"dense_attention": "seqax.kernels.attention", "causal_document_mask": "seqax.kernels.attention",
             "reference_attention": "seqax.kernels.attention", "ring_attention": "seqax.kernels.attention",
             "ring_flash_attention": "seqax.kernels.flash_attention"}
    defined = {}
    for module, path in MODULES.items():
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.FunctionDef) and node.name in where:
                defined.setdefault(node.name, []).append(module)
    assert defined == {name: [module] for name, module in where.items()}


def test_lines_of_code_are_counted_as_cloc_counts_them(tmp_path):
    path = tmp_path / "f.py"
    path.write_text('"""A docstring\nof two lines."""\n\nimport os  # a comment\n# a comment line\n\n'
                    'def f():\n    """One line."""\n    return (1,\n            2)\n')
    assert lines_of_code(str(path)) == 4  # import, def, and the return's two lines


def test_train_py_is_at_most_500_lines_of_code():
    assert lines_of_code(MODULES["train"]) <= 500


def test_train_py_is_at_most_120_columns():
    """The 500 lines are not met with wide lines (ruff's E501 checks every file; this names the line)."""
    wide = [(number, len(line.rstrip("\n"))) for number, line in enumerate(open(MODULES["train"]), start=1)
            if len(line.rstrip("\n")) > 120]
    assert not wide, f"train.py lines over 120 columns (line, width): {wide}"
