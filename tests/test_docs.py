"""The docs name only what exists: every file of ours and every module that README.md and docs/*.md
name, every link to a local file and every config a command trains; and docs/layout.md names every
module of seqax/, tools/ and bench/.

What counts as a name, read from the text (backticked or not):
- a path under one of our folders, `seqax/checkpoint.py`, `configs/ladder/base.yaml`, `bench/gpu/`
  (a `*` in it is a glob that must match something);
- a bare file name `checkpoint.py`: some folder of ours holds a file of that name;
- a module, `python -m tools.export_hf` or `seqax.config.SeqaxError`: its dotted name is a module of
  ours up to where the names become attributes;
- a config: `--config-name=NAME` and `--config NAME ...`, and the first column of README's table of
  configs;
- a markdown link whose target is not a URL.
Placeholders in capitals (`tools.NAME`, `runs/RUN`) and run outputs (`runs/...`, outside our folders)
are not names of files."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FOLDERS = ("seqax", "tools", "bench", "tests", "configs", "docs")
PACKAGES = ("seqax", "tools", "bench")

PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(FOLDERS) + r")/[\w./*-]*)")
BARE_PY = re.compile(r"(?<![\w./-])(\w+\.py)\b")
MODULE = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES + ("train", "sample")) + r")(?:\.\w+)+)")
RUN_MODULE = re.compile(r"python -m ([\w.]+)")
CONFIG = re.compile(r"--config-name[= ](\w+)|--config((?: \w+)+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")


def text_of(doc: str) -> str:
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


def our_files() -> list[str]:
    """Every file below the root, relative to it, outside hidden folders and run outputs."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        if folder == ROOT:
            dirs[:] = [d for d in dirs if d not in ("runs", "outputs", "data")]
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found += [os.path.relpath(os.path.join(folder, name), ROOT) for name in files]
    return found


FILES = our_files()
BASENAMES = {os.path.basename(f) for f in FILES}


def is_placeholder(name: str) -> bool:
    return any(PLACEHOLDER.fullmatch(part) for part in re.split(r"[/.]", name) if part)


def path_exists(path: str) -> bool:
    path = path.rstrip(".")
    if "*" in path:
        return bool(glob.glob(os.path.join(ROOT, path)))
    return os.path.exists(os.path.join(ROOT, path))


def module_exists(dotted: str) -> bool:
    """The module's dotted name is ours up to where the names become attributes: `seqax.config.SeqaxError`
    needs seqax/config.py; `seqax.shardlib.shardops.psum` needs seqax/shardlib/shardops.py."""
    first, *rest = dotted.split(".")
    path = os.path.join(ROOT, first)
    if not (os.path.isdir(path) or os.path.isfile(path + ".py")):
        return False
    for part in rest:
        if not os.path.isdir(path):
            return True  # a module: the rest are its attributes
        path = os.path.join(path, part)
        if not (os.path.isdir(path) or os.path.isfile(path + ".py")):
            return False
    return True


def configs_table(text: str) -> list[str]:
    """The config names in the first column of README's table under "## Configs"."""
    section = text.split("\n## Configs\n", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def config_exists(name: str) -> bool:
    braces = re.fullmatch(r"(\w*)\{([\w,]+)\}(\w*)", name)
    if braces:
        return all(config_exists(braces[1] + part + braces[3]) for part in braces[2].split(","))
    if name.endswith("/"):
        return os.path.isdir(os.path.join(ROOT, "configs", name))
    return bool(glob.glob(os.path.join(ROOT, "configs", name + ".yaml")))


def missing_names(text: str, doc: str = "README.md") -> dict[str, list[str]]:
    """What `text` (the doc at `doc`) names that does not exist, by kind of name."""
    missing = {"paths": [], "files": [], "modules": [], "configs": [], "links": []}
    for path in PATH.findall(LINK.sub("", text)):  # a link's target is relative to its doc: below
        if not is_placeholder(path) and not path_exists(path):
            missing["paths"].append(path)
    for name in BARE_PY.findall(text):
        if not is_placeholder(name) and name not in BASENAMES:
            missing["files"].append(name)
    for dotted in set(MODULE.findall(text)) | set(RUN_MODULE.findall(text)):
        dotted = dotted.rstrip(".")
        if dotted.split(".")[0] in PACKAGES + ("train", "sample") and not dotted.endswith(".py") \
                and not is_placeholder(dotted) and not module_exists(dotted):
            missing["modules"].append(dotted)
    for one, several in CONFIG.findall(text):
        for name in [one] if one else several.split():
            if not is_placeholder(name) and not config_exists(name):
                missing["configs"].append(name)
    for target in LINK.findall(text):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            local = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
            if not os.path.exists(local):
                missing["links"].append(target)
    return {kind: names for kind, names in missing.items() if names}


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_module_config_and_link_a_doc_names_exists(doc):
    assert missing_names(text_of(doc), doc) == {}


def test_every_config_in_readmes_table_exists():
    names = configs_table(text_of("README.md"))
    assert len(names) >= 8, "README's table of configs was not found under '## Configs'"
    assert [n for n in names if not config_exists(n)] == []


def test_names_that_do_not_exist_are_found():
    """The reading above finds each kind of name: a doc naming what is not there fails."""
    text = """See `seqax/no_such_module.py` and configs/ladder/no_such_*.yaml, or no_such_file.py;
    run `python -m tools.no_such_tool`, then seqax.no_such.function and `bench.no_such`;
    train with --config-name=no_such_config or --config local_test_synthetic no_such_other;
    read [this](docs/no_such_page.md). Not names: runs/RUN/config.yaml, python -m tools.NAME,
    `seqax/config.py`, seqax.shardlib.shardops.psum, [a site](https://example.com), [above](#configs)."""
    found = missing_names(text)
    found["modules"].sort()
    assert found == {
        "paths": ["seqax/no_such_module.py", "configs/ladder/no_such_*.yaml"],
        "files": ["no_such_file.py"],
        "modules": ["bench.no_such", "seqax.no_such.function", "tools.no_such_tool"],
        "configs": ["no_such_config", "no_such_other"],
        "links": ["docs/no_such_page.md"],
    }


def layout_names() -> set[str]:
    """The files docs/layout.md names, as paths from the root: backticked names, those under a heading that
    names a folder of the package (`seqax/`, `seqax/kernels/`) taken inside that folder."""
    names, inside = set(), ""
    for line in text_of("docs/layout.md").splitlines():
        if line.startswith("#"):
            folder = re.search(r"`(seqax/[\w/]*)`", line)
            inside = folder.group(1) if folder else ""
            continue
        for name in re.findall(r"`([^`\s]+)`", line):
            names.add(name if name.startswith(FOLDERS) else inside + name)
    return names


def test_layout_names_every_module():
    modules = [f for f in FILES if f.startswith(tuple(p + "/" for p in PACKAGES)) and f.endswith(".py")
               and os.path.basename(f) != "__init__.py"]
    assert len(modules) > 50
    assert sorted(set(modules) - layout_names()) == []
