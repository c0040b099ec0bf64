"""records.py: metrics.jsonl and TensorBoard (also on resume, and after a torn line), MFU of an
unknown device; and one short real run whose run directory holds everything a run records and
reports (profile, HLO graph, memory report, metrics, TensorBoard), which tools/plot_metrics.py draws."""

import contextlib
import gzip
import json
import os
import re
import shutil
import subprocess
import time
import types
import xml.etree.ElementTree as ElementTree

import jax
import jax.numpy as jnp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from fixtures import fill, mounted, run_train, start_train, synthetic_dataset, tiny_overrides, train_args
from seqax import config
from seqax.analysis import hardware
from seqax.records import RunRecords


def fake_config(steps: int, experts: int = 0):
    return types.SimpleNamespace(
        training=types.SimpleNamespace(steps=steps, tokens=types.SimpleNamespace(batch=4, len=8)),
        mesh=types.SimpleNamespace(d=1, t=1),
        model=types.SimpleNamespace(experts=experts),
        logging=config.LoggingConfig(wandb_project="", wandb_entity=""),
        profile_steps=0,
    )


def log_steps(run_dir, start: int, losses: dict[int, float], steps: int = 6, flops_per_token: float = 1e6,
              experts: int = 0):
    log = RunRecords(str(run_dir), "x: 1\n", fake_config(steps, experts), start, flops_per_token)
    for step, loss in losses.items():
        log.before_step(step, None)
        log.after_step(step, train.Metrics(jnp.float32(loss), jnp.float32(1e-3), jnp.float32(0.5),
                                           jnp.float32(1.25 if experts else 0.0)))
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


@pytest.mark.parametrize("experts", [0, 8])
def test_expert_load_is_logged_for_a_mixture_of_experts_only(tmp_path, monkeypatch, capsys, experts):
    """A dense run's expert_load is 0 by construction: it is neither in metrics.jsonl nor on the step line."""
    monkeypatch.setattr(hardware, "peak_flops", lambda: (1e12, "test"))
    log_steps(tmp_path, 0, {0: 1.0, 1: 0.5}, experts=experts)
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    steps = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]
    assert [l.get("expert_load") for l in lines] == ([1.25, 1.25] if experts else [None, None])
    assert all(("  expert_load 1.25  " in l) == bool(experts) for l in steps) and len(steps) == 2, steps


def test_unknown_accelerator_gives_null_mfu_and_one_warning(tmp_path, monkeypatch, capsys):
    device = types.SimpleNamespace(platform="gpu", device_kind="Imaginary X1")
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    log_steps(tmp_path, 0, {s: 1.0 for s in range(3)})
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["mfu"] for l in lines] == [None] * 3 and all(l["tokens_per_second"] > 0 for l in lines)
    warnings = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert len(warnings) == 1 and "Imaginary X1" in warnings[0], warnings


def test_mfu_on_cpu_never_reads_over_100_percent(tmp_path, monkeypatch, capsys):
    """A CPU peak measured while other work held the cores (here 1 MFLOP/s, far below what any step
    of even this tiny model runs at) is raised to the steps' model FLOP/s, with a line saying so:
    MFU is then at most 1 (was: up to 1.6 seen, any ratio possible). The raised peak is kept for the
    machine's next runs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "measure_machine_matmul_flops", lambda: 1e6)
    log_steps(tmp_path / "run", 0, {s: 1.0 for s in range(4)}, flops_per_token=1e6)
    lines = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert lines[0]["mfu"] == 1.0 and all(0 < l["mfu"] <= 1.0 for l in lines), lines
    raised = [l for l in capsys.readouterr().out.splitlines() if l.startswith("MFU's peak raised to ")]
    assert raised and "step 0 ran the model's FLOPs faster than the 1e-06 measured before" in raised[0], raised
    fastest = max(32 * 1e6 / l["step_time"] for l in lines)  # 32 tokens a step
    assert hardware.cpu_peak()[0] == pytest.approx(fastest)
    assert "fastest training step (run, step " in hardware.cpu_peak()[1]


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
        assert (run_dir / "training_step.dot").exists() and "no .svg: graphviz is not installed" in result.stdout
    assert "compiled the training step in" in result.stdout and "warning" not in result.stderr

    # training lines, not eval lines
    lines = [l for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l]
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    for l in lines:
        assert l["tokens_per_second"] > 0 and 0 < l["mfu"] <= 1 and l["step_time"] > 0
        assert "expert_load" not in l  # a dense model's has no experts
    assert [s for s, _ in scalars(run_dir, "loss")] == [0, 1, 2, 3]
    assert [v for _, v in scalars(run_dir, "loss")] == pytest.approx([l["loss"] for l in lines], rel=1e-6)
    assert len(re.findall(r"^step .* MFU .* ETA ", result.stdout, re.M)) == 4


@pytest.mark.slow
def test_the_memory_report_sets_the_estimate_against_xla(short_run):
    """The run prints and writes the memory report, with XLA:CPU's plan and the estimate's ratio to it.
    The estimate models what a GPU or TPU holds; it is checked against their compilers' plans
    (tests/test_compile_for.py, within 30%). XLA:CPU plans more for the unrolled layers (0.65 here,
    2026-12-04: it keeps more of the step alive at once and the gathered weights from the forward
    pass to the backward), so here the ratio is only bounded by what an estimate of the same step
    can be: more than half, at most 1.3."""
    run_dir, result = short_run
    report = (run_dir / "memory_report.txt").read_text()
    ratio = float(re.search(r"estimate / XLA peak = ([\d.]+)", report).group(1))
    assert 0.5 <= ratio <= 1.3, report
    planned = re.search(r"peak: max.* ([\d.]+) MiB", report).group(1)
    line = (rf"^memory per device: {float(planned):.1f} MiB as XLA plans it \(.* MiB estimated from the code\) "
            r"x 8 devices of the host's [\d.]+ GiB \([\d.]+%\): memory_report.txt$")
    assert re.search(line, result.stdout, re.M), result.stdout


@pytest.mark.slow
def test_the_console_before_the_first_step_fits_a_screen(short_run):
    """The start-up reports are files; the console gets a line of each (was: about 60 lines), and the
    run ends with the median step's MFU, the figure that compares runs."""
    run_dir, result = short_run
    before = result.stdout[:result.stdout.index("\nstep ")].splitlines()
    assert len(before) <= 8, before
    assert before[0].startswith("MFU against ") and "communication per device per step: " in result.stdout
    step_times = [l["step_time"] for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l][1:]
    median = re.search(r"^median of 3 steps after the first: (\d+) ms, \d+ tok/s, MFU [\d.]+%$", result.stdout, re.M)
    assert median and int(median.group(1)) == round(1000 * sorted(step_times)[1]), result.stdout


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


# ---------------------------------------------------------------------------------------------
# A run directory that cannot be written: full (a small tmpfs) or read-only, as the kernel makes
# them (fixtures.mounted). Required records stop the run with one line naming the file, its
# checkpoints intact; the optional ones (the profile, the graph) warn and training goes on.


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> str:
    return synthetic_dataset(tmp_path_factory.mktemp("data") / "small.zarr", "--train-tokens", "60000",
                             "--validation-tokens", "5000")


def faulty_run(root, dataset: str, *overrides: str, graph: bool = False) -> subprocess.CompletedProcess:
    args = train_args(root, dataset, "run", *tiny_overrides(*overrides))
    return run_train(args, cache=root.parent / "jax_cache", graph=graph)


def split_stderr(result) -> tuple[list[str], list[str]]:
    """(warnings, everything else) of a run's stderr; never a traceback."""
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return ([l for l in lines if l.startswith("seqax: warning: ")],
            [l for l in lines if not l.startswith("seqax: warning: ")])


def unchanged_steps(run_dir) -> list[int]:
    return [l["step"] for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l]


@pytest.mark.slow
def test_a_3mb_disk_warns_for_the_profile_then_stops_with_one_line_and_the_run_resumes(small_dataset, tmp_path):
    """The fault as found: a 3 MiB tmpfs as paths.root_working_dir. The profile (about 5 MiB) fails
    at step 2, a warning (was: an 18-line RESOURCE_EXHAUSTED traceback, exit 1); a later record
    fails (its buffered write or TensorBoard's flush, whichever fills the disk), one line naming the
    file, exit 2. Given room, the same command resumes from the newest committed checkpoint."""
    overrides = ("training.steps=30", "checkpoint_interval=4", "checkpoints.keep=1", "eval_interval=0",
                 "profile_steps=2")
    with mounted(tmp_path / "disk", "size=3m") as disk:
        result = faulty_run(disk, small_dataset, *overrides)
        warnings, errors = split_stderr(result)
        assert result.returncode == 2, result.stderr[-3000:]
        assert any(re.match(rf"seqax: warning: could not write the profile of steps 1-2 to {disk}/run/profile: "
                            r"RESOURCE_EXHAUSTED: .*No space left on device; training goes on without it", w)
                   for w in warnings), warnings
        assert len(errors) == 1 and re.match(rf"seqax: error: (cannot write|writing a checkpoint in) {disk}/run\S* .*"
                                             "No space left on device", errors[0]), errors
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = faulty_run(disk, small_dataset, *overrides)
        assert again.returncode == 0 and split_stderr(again)[1] == [], again.stderr[-3000:]
        assert set(unchanged_steps(disk / "run")) == set(range(30))


@pytest.mark.slow
def test_metrics_on_a_disk_that_fills_mid_run_stop_with_one_line_and_the_run_resumes(small_dataset, tmp_path):
    """The run directory fills after a few steps (the test writes a file over its free space);
    TensorBoard and the checkpoints are on disks of their own, so metrics.jsonl's next line is the
    write that fails: one line naming it, exit 2; then, with the space freed, the same command
    resumes from checkpoint 4 and finishes."""
    run_dir, overrides = tmp_path / "disk" / "run", ("training.steps=200", "checkpoint_interval=4", "eval_interval=0")
    with contextlib.ExitStack() as mounts:
        disk = mounts.enter_context(mounted(tmp_path / "disk", "size=8m"))
        for other in ("tensorboard", "checkpoints", "profile"):
            mounts.enter_context(mounted(run_dir / other, "size=64m"))
        run = start_train(train_args(disk, small_dataset, "run", *tiny_overrides(*overrides)),
                          cache=tmp_path.parent / "jax_cache", graph=False, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not (os.path.exists(run_dir / "metrics.jsonl") and len(unchanged_steps(run_dir)) >= 6):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
            time.sleep(0.05)
        filler = fill(disk)
        _, err = run.communicate(timeout=120)
        assert run.returncode == 2 and "Traceback" not in err, err[-3000:]
        errors = [l for l in err.strip().splitlines() if not l.startswith("seqax: warning: ")]
        assert errors == [f"seqax: error: cannot write {run_dir}/metrics.jsonl: No space left on device; the run "
                          "stops here, its checkpoints intact: free space (or fix the permission) and run the same "
                          "command again to resume from the newest checkpoint"], err[-3000:]
        os.remove(filler)
        again = faulty_run(disk, small_dataset, "training.steps=30", *overrides[1:])
        assert again.returncode == 0 and split_stderr(again)[1] == [], again.stderr[-3000:]
        assert set(unchanged_steps(run_dir)) == set(range(30))
        assert os.listdir(run_dir / "profile") == []  # profile_steps=0 (fixtures.TINY): neither run traced a step


@pytest.mark.slow
def test_optional_outputs_that_cannot_be_written_warn_and_training_goes_on(small_dataset, tmp_path):
    """The profile (of profile_steps 3) on a 256 KiB disk of its own; training_step.dot where a directory of
    that name is."""
    run_dir = tmp_path / "run"
    (run_dir / "training_step.dot").mkdir(parents=True)
    with mounted(run_dir / "profile", "size=256k"):
        result = faulty_run(tmp_path, small_dataset, "training.steps=5", "eval_interval=0", "profile_steps=3",
                            graph=True)
    warnings, errors = split_stderr(result)
    assert result.returncode == 0 and errors == [], result.stderr[-3000:]
    assert len(warnings) == 2, warnings
    assert warnings[0] == (f"seqax: warning: could not write {run_dir}/training_step.dot: Is a directory; there is no "
                           "graph of the step (it is optional)")
    assert re.match(rf"seqax: warning: could not write the profile of steps 1-3 to {run_dir}/profile: .*No space left "
                    r"on device; training goes on without it \(the profile is optional\)$", warnings[1]), warnings
    assert unchanged_steps(run_dir) == list(range(5))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["read_only_root", "no_room_for_the_hlo"])
def test_a_report_or_a_run_directory_that_cannot_be_written_stops_before_the_first_step(small_dataset, tmp_path, where):
    with mounted(tmp_path / "disk", "ro" if where == "read_only_root" else "size=512k") as disk:
        result = faulty_run(disk, small_dataset, "training.steps=5")
        _, errors = split_stderr(result)
        assert result.returncode == 2 and not re.search(r"^step ", result.stdout, re.M), result.stderr[-3000:]
        expected = (f"seqax: error: cannot write {disk}/run: Read-only file system; a run writes its directory "
                    if where == "read_only_root" else
                    f"seqax: error: cannot write {disk}/run/training_step.hlo.txt: No space left on device; the run "
                    "stops before its first step")
        assert len(errors) == 1 and errors[0].startswith(expected), errors


@pytest.mark.slow
def test_a_resumed_run_says_from_where_and_a_finished_one_that_there_is_nothing_to_do(short_run, default_dataset,
                                                                                      tmp_path):
    """The same command again on a finished run says so and stops before compiling, writing nothing (was:
    ~15 s of compiling and the reports, silently); with more steps it says which checkpoint it resumed
    from and when that was written."""
    run_dir, _ = short_run
    shutil.copytree(run_dir, tmp_path / "obs")
    files = lambda: {str(p): p.stat().st_mtime for p in (tmp_path / "obs").rglob("*") if p.name != ".lock"}  # noqa: E731
    before = files()
    result = run_train(train_args(tmp_path, default_dataset, "obs", "training.steps=4"))
    assert result.returncode == 0 and result.stdout == "run complete at step 4: nothing to do (training.steps=4)\n", (
        result.stdout, result.stderr[-3000:])
    assert files() == before  # only the lock was taken

    written = os.path.getmtime(tmp_path / "obs" / "checkpoints" / "0000000004" / "zarr.json")
    result = run_train(train_args(tmp_path, default_dataset, "obs", "training.steps=6"), graph=False)
    assert result.returncode == 0, result.stderr[-3000:]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written))
    first = result.stdout.splitlines()[0]
    said = re.escape(f"resumed from checkpoint 4 (written {when}, ") + r"\d+:\d\d:\d\d ago\): steps 4-5 to go"
    assert re.fullmatch(said, first), first
    assert re.findall(r"^step +(\d+)/6 ", result.stdout, re.M) == ["4", "5"]
