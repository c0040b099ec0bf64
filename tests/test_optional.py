"""optional.py: a tool whose package (requirements-tools.txt) is not installed stops with one line naming
`make tools`, which installs every package the tools import."""

import json
import os
import re
import subprocess
import sys

import pytest

from seqax.optional import MissingPackage, require
from tools import lm_eval_task, plot_metrics, prepare_dataset

INSTALL = "`make tools` installs it (requirements-tools.txt)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hide(monkeypatch, *modules: str):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # its import fails as when it is not installed


def one_error_line(capsys, call) -> str:
    with pytest.raises(SystemExit) as stopped:
        call()
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_plot_metrics_without_matplotlib_is_one_line_naming_make_tools(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    hide(monkeypatch, "matplotlib", "matplotlib.pyplot")
    line = one_error_line(capsys, lambda: plot_metrics.main([str(tmp_path)]))
    assert line == f"seqax: error: tools.plot_metrics needs the `matplotlib` package, which is not installed: {INSTALL}"
    assert not (tmp_path / "metrics.png").exists()


def test_prepare_dataset_without_pyarrow_is_one_line_naming_make_tools(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    hide(monkeypatch, "pyarrow", "pyarrow.parquet")
    with pytest.raises(SystemExit) as stopped:
        prepare_dataset.main([str(tmp_path / "a.parquet"), "--output", str(tmp_path / "out.zarr")])
    err = capsys.readouterr().err  # after its progress bar
    assert stopped.value.code == 2 and err.endswith(
        f"prepare_dataset: error: tools.prepare_dataset on a .parquet file needs the `pyarrow` package, which is not "
        f"installed: {INSTALL}\n"), err


def test_lm_eval_task_without_lm_eval_writes_the_tasks_and_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    """The task configs need no package; lm_eval, which reads them, does: one warning line."""
    task = tmp_path / "choices.jsonl"
    task.write_text(json.dumps({"context": "1 + 1 =", "choices": [" 2", " 3"], "label": 0}) + "\n")
    hide(monkeypatch, "lm_eval")
    lm_eval_task.main([str(task), "--output", str(tmp_path / "tasks")])
    assert (tmp_path / "tasks" / "choices.yaml").exists()
    assert capsys.readouterr().err == ("seqax: warning: lm-evaluation-harness (`lm_eval`), which reads these tasks, "
                                       f"is not installed: {INSTALL}\n")


def test_a_broken_package_is_not_called_missing(tmp_path, monkeypatch):
    """A package that is there but fails to import (one of its own imports missing) gives its own error."""
    (tmp_path / "broken_tool.py").write_text("import a_module_it_lacks\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_module_it_lacks"):
        require("broken_tool", "a test")
    with pytest.raises(MissingPackage, match="^a test needs the `absent_tool` package, which is not installed: "):
        require("absent_tool", "a test")


def requirement_names(path: str) -> set[str]:
    with open(path) as f:
        return {re.split(r"[=<>~ ]", line.strip())[0].lower() for line in f if line.strip()[:1].isalnum()}


def test_make_tools_installs_what_the_tools_import():
    """`make tools` installs requirements-tools.txt, which make test's requirements include."""
    dry_run = subprocess.run(["make", "-n", "-B", "tools"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert ".venv/bin/pip install -q -r requirements-tools.txt" in dry_run.stdout
    tools = requirement_names(os.path.join(ROOT, "requirements-tools.txt"))
    assert {"tensorboard", "matplotlib", "torch", "transformers", "lm-eval", "accelerate", "pyarrow",
            "datasets"} <= tools
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        assert "-r requirements-tools.txt" in f.read().splitlines()


@pytest.mark.slow  # trains a run to export
def test_the_export_without_torch_is_one_line_naming_make_tools_and_leaves_no_output(tmp_path, monkeypatch, capsys):
    """The export checks its logits with transformers on torch (requirements-tools.txt): without them it stops
    with the one line that names `make tools`, and nothing of the export is left."""
    from fixtures import checkpointed_bytes_run
    from tools import export_hf

    run_dir = checkpointed_bytes_run(tmp_path)
    hide(monkeypatch, "torch", "transformers")
    export = ["--run-dir", run_dir, "--output", str(tmp_path / "hf")]
    line = one_error_line(capsys, lambda: export_hf.main(export))
    assert line == ("seqax: error: the export's logits check needs the `torch` package, which is not installed: "
                    + INSTALL)
    assert sorted(os.listdir(tmp_path)) == ["data.zarr", "run"]
