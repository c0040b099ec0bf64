"""Outputs never overlap inputs (seqax/outputs.py, docs/reliability.md): every tool that replaces or
writes a file refuses an output that is, holds or lies inside what it reads, with one line, before
anything is written; the inputs stay byte for byte."""

import json
import os
import subprocess
import sys
from functools import partial

import pytest

from fixtures import ROOT, checkpointed_bytes_run, child_env, snapshot
from tools import export_hf, make_choice_task, plot_metrics, prepare_dataset


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """root/run: a tiny bytes-tokenized model's config.yaml and checkpoint 1; root/data.zarr its dataset."""
    return checkpointed_bytes_run(tmp_path_factory.mktemp("root"))


def one_error_line(capsys, call, prefix: str = "seqax: error: ") -> str:
    with pytest.raises(SystemExit) as exit:
        call()
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0]


@pytest.mark.slow  # a child process that imports jax and train (about 4 s)
def test_an_export_onto_its_own_run_is_refused_and_the_run_stays_byte_for_byte(run_dir):
    """The export with --overwrite and --output set to the run directory itself (it deleted the run, exit 0):
    one line, exit 2, every file of the run (checkpoint, config) and of its parent unchanged."""
    root = os.path.dirname(run_dir)
    before = snapshot(root)
    result = subprocess.run([sys.executable, "-m", "tools.export_hf", "--run-dir", run_dir, "--output", run_dir,
                             "--overwrite"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"seqax: error: --output {run_dir!r} is or contains the run directory {run_dir!r} (--run-dir), which "
        "writing it would delete; choose another --output"]
    assert snapshot(root) == before and sorted(os.listdir(root)) == ["data.zarr", "run"]


@pytest.mark.parametrize("where,says", [
    ("parent", "is or contains the run directory"),
    ("inside", "lies inside the run directory"),
    ("checkpoints", "is or contains its checkpoints"),
    ("dataset", "is or contains the dataset"),
])
def test_the_export_refuses_an_output_that_overlaps_what_it_reads(run_dir, tmp_path, capsys, where, says):
    """The run's parent, a folder inside the run, its checkpoints where a link puts them outside the run, or
    the dataset as --output (with --overwrite): one line naming what it reads there; nothing changes."""
    root = os.path.dirname(run_dir)
    if where == "checkpoints":  # a run whose checkpoints are a link to the module's run's
        os.makedirs(tmp_path / "linked")
        (tmp_path / "linked" / "config.yaml").write_bytes(open(os.path.join(run_dir, "config.yaml"), "rb").read())
        os.symlink(os.path.join(run_dir, "checkpoints"), tmp_path / "linked" / "checkpoints")
    reader = str(tmp_path / "linked") if where == "checkpoints" else run_dir
    output = {"parent": root, "inside": os.path.join(run_dir, "hf"),
              "checkpoints": os.path.join(run_dir, "checkpoints"), "dataset": os.path.join(root, "data.zarr")}[where]
    before = snapshot(root)
    line = one_error_line(capsys, lambda: export_hf.main(["--run-dir", reader, "--output", output, "--overwrite"]))
    assert line.startswith(f"seqax: error: --output {output!r} {says} "), line
    assert snapshot(root) == before


def test_prepare_dataset_refuses_an_output_inside_an_input_directory_or_a_validation_input(tmp_path, capsys):
    """A dataset written into the folder it reads would be read back as input by the next run (its zarr.json
    files are .json inputs); a --validation-inputs file is an input too."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("a document\n\nanother one\n")
    held = tmp_path / "held.txt"
    held.write_text("held out\n")
    before = snapshot(tmp_path)
    for output, says in ((texts / "data.zarr", f"lies inside the input '{texts}'"),
                         (held, f"is or contains the input '{held}'")):
        argv = [str(texts), "--validation-inputs", str(held), "--output", str(output), "--overwrite", "--workers", "1",
                "--quiet"]
        line = one_error_line(capsys, partial(prepare_dataset.main, argv), prefix="prepare_dataset: error: ")
        assert line.startswith(f"prepare_dataset: error: --output '{output}' {says}"), line
    assert snapshot(tmp_path) == before


def test_make_choice_task_refuses_an_output_inside_its_dataset(run_dir, capsys):
    data = os.path.join(os.path.dirname(run_dir), "data.zarr")
    before = snapshot(data)
    output = os.path.join(data, "zarr.json")
    line = one_error_line(capsys, lambda: make_choice_task.main(["--dataset", data, "--output", output]))
    assert line.startswith(f"seqax: error: --output {output!r} lies inside the dataset {data!r} (--dataset)")
    assert snapshot(data) == before


def test_plot_metrics_refuses_to_draw_over_the_metrics_it_reads(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "loss": 5.0, "learning_rate": 0.1, "grad_norm": 1.0}) + "\n")
    with pytest.raises(SystemExit) as exit:
        plot_metrics.main([str(run), "--output", str(metrics)])
    assert exit.value.code == 2
    assert f"--output '{metrics}' is or contains the metrics '{metrics}'" in capsys.readouterr().err
    assert json.loads(metrics.read_text())["loss"] == 5.0


def test_plot_metrics_draws_the_task_panel_only_for_runs_that_scored_tasks(tmp_path):
    """A run without evaluation tasks gets no empty accuracy panel; one that scored a task gets it, its line drawn."""
    line = {"step": 0, "loss": 5.0, "learning_rate": 0.1, "grad_norm": 1.0, "tokens_per_second": 10.0}
    panels = []
    for name, extra in (("plain", {}), ("tasks", {"text_choices/acc": 0.5, "text_choices/acc_norm": 0.4})):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({**line, **extra}) + "\n")
        fig = plot_metrics.figure([str(run)])
        panels.append({ax.get_title(): (ax.get_visible(), len(ax.lines)) for ax in fig.axes})
        plot_metrics.pyplot().close(fig)
    assert panels[0]["multiple-choice tasks: accuracy"] == (False, 0) and panels[0]["loss"] == (True, 1)
    assert panels[1]["multiple-choice tasks: accuracy"] == (True, 2)
