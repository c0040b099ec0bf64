"""records.py: metrics.jsonl and TensorBoard (also on resume, and after a torn line), MFU of an
unknown device; and one short real run whose run directory holds everything a run records and
reports (profile, HLO graph, memory report, metrics, TensorBoard), which tools/plot_metrics.py draws."""

import gzip
import json
import re
import shutil
import types
import xml.etree.ElementTree as ElementTree

import jax
import jax.numpy as jnp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from fixtures import run_train, train_args
from seqax import config, hardware
from seqax.records import RunRecords


def fake_config(steps: int):
    return types.SimpleNamespace(
        training=types.SimpleNamespace(steps=steps, tokens=types.SimpleNamespace(batch=4, len=8)),
        mesh=types.SimpleNamespace(d=1, t=1),
        logging=config.LoggingConfig(wandb_project="", wandb_entity=""),
    )


def log_steps(run_dir, start: int, losses: dict[int, float], steps: int = 6):
    log = RunRecords(str(run_dir), "x: 1\n", fake_config(steps), start, flops_per_token=1e6, profiled_steps=0)
    for step, loss in losses.items():
        log.before_step(step, None)
        log.after_step(step, train.Metrics(jnp.float32(loss), jnp.float32(1e-3), jnp.float32(0.5)))
    log.close()


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_on_resume_shows_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "peak_flops", lambda: (1e12, "test"))
    log_steps(tmp_path, 0, {s: float(s) for s in range(5)})  # crashed after step 4, checkpoint 3
    log_steps(tmp_path, 3, {s: 10.0 + s for s in range(3, 6)})
    assert scalars(tmp_path, "loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["step"] for l in lines] == [0, 1, 2, 3, 4, 3, 4, 5]  # appended: the re-run steps twice


def test_resume_drops_a_torn_last_metrics_line(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "peak_flops", lambda: (1e12, "test"))
    log_steps(tmp_path, 0, {0: 1.0, 1: 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # killed while writing step 2's line
    log_steps(tmp_path, 2, {2: 3.0})
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [(l["step"], l["loss"]) for l in lines] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_unknown_accelerator_gives_null_mfu_and_one_warning(tmp_path, monkeypatch, capsys):
    device = types.SimpleNamespace(platform="gpu", device_kind="Imaginary X1")
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    log_steps(tmp_path, 0, {s: 1.0 for s in range(3)})
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["mfu"] for l in lines] == [None] * 3 and all(l["tokens_per_second"] > 0 for l in lines)
    warnings = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert len(warnings) == 1 and "Imaginary X1" in warnings[0], warnings


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, default_dataset):
    """Four steps of local_test_synthetic, as `make train` runs it (on its dataset)."""
    root = tmp_path_factory.mktemp("runs")
    result = run_train(train_args(root, default_dataset, "obs", "training.steps=4"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "obs", result


@pytest.mark.slow
def test_short_run_writes_profile_graph_memory_metrics_and_tensorboard(short_run):
    run_dir, result = short_run
    traces = list((run_dir / "profile").glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert sum("training_step" in str(e.get("name", "")) for e in events) >= 2
    if shutil.which("dot"):
        assert ElementTree.parse(run_dir / "training_step.svg").getroot().tag.endswith("svg")
    else:
        assert (run_dir / "training_step.dot").exists() and "graphviz" in result.stderr
    assert "compiled the training step in" in result.stdout

    # training lines, not eval lines
    lines = [l for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l]
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    for l in lines:
        assert l["tokens_per_second"] > 0 and 0 < l["mfu"] < 1.5 and l["step_time"] > 0
    assert [s for s, _ in scalars(run_dir, "loss")] == [0, 1, 2, 3]
    assert [v for _, v in scalars(run_dir, "loss")] == pytest.approx([l["loss"] for l in lines], rel=1e-6)
    assert len(re.findall(r"^step .* MFU .* ETA ", result.stdout, re.M)) == 4


@pytest.mark.slow
def test_memory_estimate_is_within_30_percent_of_xla(short_run):
    run_dir, result = short_run
    report = (run_dir / "memory_report.txt").read_text()
    assert report in result.stdout
    ratio = float(re.search(r"estimate / XLA peak = ([\d.]+)", report).group(1))
    assert 0.7 <= ratio <= 1.3, report


@pytest.mark.slow
def test_plot_metrics_draws_two_runs(short_run, tmp_path):
    from tools import plot_metrics

    run_dir, _ = short_run
    other = tmp_path / "other"
    other.mkdir()
    lines = [l for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l]
    with open(other / "metrics.jsonl", "w") as f:
        for l in lines:
            f.write(json.dumps({**l, "loss": l["loss"] + 0.5}) + "\n")
        f.write(json.dumps({"step": 3, "eval_loss": 6.0}) + "\n")
    output = tmp_path / "plot.png"
    plot_metrics.main([str(run_dir), str(other), "--output", str(output)])
    data = output.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
