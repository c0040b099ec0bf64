"""The benchmarks: bench/throughput.py's rows and table (a config per child process, skipped,
failed, timed-out and not-run rows), bench/gpu/gpu.sh end to end on CPU and its fail-fast checks,
bench/profile_step.py on a real trace,
and the ladder configs (complete, valid, the size their names say, and fitting their accelerator
with room to spare). bench/compare_commits.py against HEAD. bench/mesh_agreement.py's table and
its one-line refusals."""

import argparse
import dataclasses
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import pytest

import train
from bench import compare_commits, compile_for, measure_step, memory, mesh_agreement, throughput
from fixtures import TINY, synthetic_dataset
from seqax import config
from seqax.analysis.roofline import Kernel
from seqax.validation import validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LADDER = ["gpu1_125m", "gpu1_350m", "gpu1_1b", "gpu1_2b", "gpu8_125m", "gpu8_350m", "gpu8_1b", "gpu8_2b", "tpu8_1b"]
# The seed's scale: 128 devices, more than a test machine simulates (bench/compile_for.py compiles them).
LARGE = ["gpu128_7b", "tpu128_7b"]
# local_test_synthetic shrunk to a few seconds of work on one CPU device.
TINY_ONE_DEVICE = ("mesh.d=1 mesh.t=1 model.layers=1 training.tokens.batch=4 training.tokens.len=32 "
                   "model.attention_block=16")


def run_gpu_sh(tmp_path, **env):
    """bench/gpu/gpu.sh with this test's Python, no wheels folder and the given variables."""
    full_env = {**os.environ, "PYTHON": sys.executable, "SEQAX_BENCH_WHEELS": str(tmp_path / "no_wheels"), **env}
    started = time.monotonic()
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu", "gpu.sh")], env=full_env, capture_output=True,
                            text=True, timeout=240)
    return result, time.monotonic() - started


def assert_fails_fast_with_one_line(result, seconds, *phrases):
    assert result.returncode == 1, result
    assert result.stdout == "", result.stdout  # no table
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench/gpu/gpu.sh: error: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    assert seconds < 30, seconds


@pytest.mark.slow
def test_gpu_sh_on_cpu_prints_the_table_last_with_a_measured_row(tmp_path):
    rows_file = tmp_path / "rows.json"
    result, _ = run_gpu_sh(tmp_path, SEQAX_BENCH_ALLOW_CPU="1", SEQAX_BENCH_CONFIGS="local_test_synthetic",
                           SEQAX_BENCH_OVERRIDES=TINY_ONE_DEVICE, SEQAX_BENCH_STEPS="2", SEQAX_BENCH_WARMUP="1",
                           SEQAX_BENCH_JSON=str(rows_file),
                           # XLA's backend optimizations off: half the compile time; this checks the plumbing,
                           # not the speed.
                           XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0")
    assert result.returncode == 0, result.stderr
    [row] = json.loads(rows_file.read_text())
    assert row["status"] == "ok" and row["devices"] == "1 x cpu" and row["mesh"] == "d=1 t=1", row
    assert row["steps"] == 2 and row["warmup"] == 1 and row["tokens_per_step"] == 4 * 32
    assert 0 < row["step_time_min_s"] <= row["step_time_median_s"] <= row["step_time_max_s"]
    assert row["tokens_per_second"] == pytest.approx(128 / row["step_time_median_s"])
    assert row["mfu"] > 0 and row["peak_memory_bytes"] > 0 and row["peak_memory_source"] == "XLA estimate"
    # The table is the last thing printed: header, rule, the row.
    header, rule, line = result.stdout.strip().splitlines()[-3:]
    assert header.startswith("| config ") and set(rule) <= {"|", "-", " "}
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[:4] == ["local_test_synthetic", "1 x cpu", "d=1 t=1", "2 after 1"]
    assert cells[5] == "" and row["predicted_step_time_s"] is None  # no roofline for a CPU: not a target
    assert cells[6] == f"{row['tokens_per_second']:,.0f}"
    assert "1 x cpu (cpu)" in result.stderr  # what the check found


@pytest.mark.slow  # gpu.sh in bash with pip (about 2 s)
def test_gpu_sh_fails_fast_naming_a_missing_package(tmp_path):
    fake = tmp_path / "site" / "hydra"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'hydra'\", name='hydra')\n")
    result, seconds = run_gpu_sh(tmp_path, SEQAX_BENCH_ALLOW_CPU="1", PYTHONPATH=str(tmp_path / "site"))
    assert_fails_fast_with_one_line(result, seconds, "hydra-core", "is missing", "no_wheels is absent",
                                    "bench/gpu/gpu_wheels.sh")


@pytest.mark.slow
def test_gpu_sh_fails_fast_without_a_gpu(tmp_path):
    result, seconds = run_gpu_sh(tmp_path)
    assert_fails_fast_with_one_line(result, seconds, "no GPU visible to JAX", "cpu")


def test_gpu_sh_fails_fast_on_an_old_jax(tmp_path):
    fake = tmp_path / "site" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.4.30'\n")
    result, seconds = run_gpu_sh(tmp_path, PYTHONPATH=str(tmp_path / "site"))
    assert_fails_fast_with_one_line(result, seconds, "jax 0.4.30 is too old", ">= 0.10")


@pytest.mark.slow  # gpu.sh in bash with pip (about 2 s)
def test_gpu_sh_fails_fast_on_wheels_that_do_not_install(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_text("not a zip file")
    result, seconds = run_gpu_sh(tmp_path, SEQAX_BENCH_WHEELS=str(wheels))
    assert_fails_fast_with_one_line(result, seconds, "pip could not install", "bench/gpu/gpu_wheels.sh")


@pytest.mark.slow
def test_gpu_sh_fails_fast_with_the_reason_of_an_unforeseen_failure(tmp_path):
    """XLA aborting on a flag it does not know (as jaxlib may after an upgrade) and a package
    that breaks on import are not among gpu_check's checks: the one line is their own error."""
    result, seconds = run_gpu_sh(tmp_path, SEQAX_BENCH_ALLOW_CPU="1", XLA_FLAGS="--xla_no_such_flag=1")
    assert_fails_fast_with_one_line(result, seconds, "Unknown flag in XLA_FLAGS: --xla_no_such_flag=1")
    broken = tmp_path / "site" / "zarr"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise AttributeError('zarr broke on import')\n")
    result, seconds = run_gpu_sh(tmp_path, SEQAX_BENCH_ALLOW_CPU="1", PYTHONPATH=str(tmp_path / "site"))
    assert_fails_fast_with_one_line(result, seconds, "AttributeError: zarr broke on import")


def run_throughput(*args):
    return subprocess.run([sys.executable, "-m", "bench.throughput", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.slow
def test_profile_step_sums_a_real_trace_and_keeps_it(tmp_path):
    """bench/profile_step.py on one CPU device: two traced steps summed per timeline (a CPU's trace has
    no device, so the host's timelines), whose totals add up to every complete event of the trace
    it keeps; the trace and the step's HLO copied to --out."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "bench.profile_step", "--config", "local_test_synthetic", "--top",
                             "3", "--out", str(out), "--", *TINY_ONE_DEVICE.split()], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "XLA_FLAGS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^traced 2 step\(s\): [\d.]+ ms a step by the host's clock$", result.stdout, re.M), result.stdout
    totals = [float(ms) for ms in re.findall(r"^\S.*: ([\d.]+) ms a step in \d+ events a step, \d+ names$",
                                            result.stdout, re.M)]
    with gzip.open(out / "local_test_synthetic.trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    traced = sum(e.get("dur", 0) for e in events if e.get("ph") == "X") / 1e3 / 2
    assert totals and traced > 0
    assert sum(totals) == pytest.approx(traced, abs=0.05 * len(totals) + 1e-3 * traced)
    with gzip.open(out / "local_test_synthetic.hlo.txt.gz", "rt") as f:
        assert "ENTRY" in f.read()


@pytest.mark.slow
def test_throughput_rows_for_a_mesh_that_does_not_fit_and_a_bad_config(tmp_path):
    """8 devices (conftest): gpu1_125m's 1x1 mesh is skipped; a batch that mesh.d=4 does not
    divide fails with the config error's fix; the table still comes, with both rows."""
    result = run_throughput("--config", "gpu1_125m", "local_test_synthetic", "--json", str(tmp_path / "rows.json"),
                            "--", "training.tokens.batch=3")
    assert result.returncode == 0, result.stderr
    skipped, failed = json.loads((tmp_path / "rows.json").read_text())
    assert (skipped["status"] == "skipped"
            and skipped["note"] == "its mesh is for 1 device(s), this machine has 8"), skipped
    assert (failed["status"] == "failed" and "ConfigError" in failed["note"]
            and "training.tokens.batch=3" in failed["note"]), failed
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[2].startswith("| gpu1_125m ") and lines[3].startswith("| local_test_synthetic ")


def test_a_mesh_with_c_counts_its_devices():
    """mesh.c multiplies the devices a config needs: on 8 devices a 1x1x4 mesh is skipped, named with its c."""
    row = measure_step.measure("local_test_synthetic", ["mesh.d=1", "mesh.t=1", "mesh.c=4"], steps=1, warmup=0)
    assert (row.status, row.mesh, row.note) == ("skipped", "d=1 t=1 c=4",
                                                "its mesh is for 4 device(s), this machine has 8"), row


def test_throughput_timeout_and_budget_become_rows(tmp_path):
    started = time.monotonic()
    result = run_throughput("--config", "local_test_synthetic", "local_bench_cpu", "--timeout", "1", "--budget", "1",
                            "--json", str(tmp_path / "rows.json"))
    assert result.returncode == 0, result.stderr
    timed_out, not_run = json.loads((tmp_path / "rows.json").read_text())
    assert timed_out["status"] == "timeout" and timed_out["note"].startswith("no result within 1 s"), timed_out
    assert not_run["status"] == "not run" and "--budget of 1 s" in not_run["note"], not_run
    assert time.monotonic() - started < 20  # the child was killed, not waited for


def test_table_escapes_cells_and_keeps_columns():
    rows = [throughput.Row(config="a", status="failed", note="x | y"),
            throughput.Row(config="b", status="not run", note="budget")]
    lines = throughput.table(rows).splitlines()
    assert len(lines) == 4 and "x \\| y" in lines[2]
    assert len({len(line) for line in lines}) == 1  # padded to the same widths
    assert all(len(re.findall(r"(?<!\\)\|", line)) == len(throughput.HEADER) + 1 for line in lines)


def test_throughput_rejects_an_override_among_config_names():
    result = run_throughput("--config", "local_test_synthetic", "mesh.d=8")
    assert result.returncode == 2 and "put hydra overrides after --" in result.stderr


def test_the_ladders_mixture_of_experts_has_the_1b_active_parameters_and_fits():
    """gpu8_1b_moe: gpu8_1b with each layer's MLP of d_ff hidden units made experts of which a token's
    experts_per_token have d_ff in all (its active parameters and FLOPs those of gpu8_1b, a router aside,
    whatever train.py's MLP and experts compute); 5.9B parameters in all; memory.py's estimate within 2/3
    of an H200."""
    moe, dense = (config.load_config(name, ["+paths.model_name=check"]) for name in ("gpu8_1b_moe", "gpu8_1b"))
    validate_config(moe, 8, max_token_id=32766, weights=train.Model)
    m = moe.model
    assert m.d_ff + m.experts_per_token * m.expert_d_ff == dense.model.d_ff
    mlp = ("d_ff", "experts", "experts_per_token", "expert_d_ff", "expert_block")
    assert dataclasses.replace(m, **{key: getattr(dense.model, key) for key in mlp}) == dense.model
    weights = jax.eval_shape(lambda: train.init_weights(m, jax.random.key(0)))
    assert math.isclose(sum(math.prod(w.shape) for w in jax.tree.leaves(weights)), 5.88e9, rel_tol=0.01)
    terms, *_ = memory.accelerator_estimate(moe, memory.config_mesh(moe))
    assert sum(size for _, size in terms) <= 2 / 3 * DEVICE_MEMORY["gpu"]


def llama_parameters(m) -> int:
    """The parameters of a Llama (untied embeddings, a SwiGLU MLP) of model config `m`'s dimensions: the size
    a ladder config's name says. The names are of the dimensions, not of train.py's model, so that an edit
    of the model (a gate-less MLP) leaves them true; what the edit costs is the memory tests' to say."""
    attention = m.d_model * m.n_kv * m.d_head * (2 * m.n_q_per_kv + 2)  # w_q, w_o; w_k, w_v
    return 2 * m.vocab * m.d_model + m.layers * (attention + 3 * m.d_model * m.d_ff + 2 * m.d_model) + m.d_model


@pytest.mark.parametrize("name", LADDER + LARGE)
def test_ladder_config_is_valid_and_the_size_its_name_says(name):
    cfg = config.load_config(name, ["+paths.model_name=check"])
    n_devices = cfg.mesh.d * cfg.mesh.t
    validate_config(cfg, n_devices, max_token_id=32766, weights=train.Model)  # a 32,767-token tokenizer, ids stored +1
    assert cfg.model.vocab == 32768 and cfg.model.attention_block == 512 and cfg.training.tokens.len == 2048
    size = name.split("_")[1]
    assert math.isclose(llama_parameters(cfg.model), {"125m": 125e6, "350m": 350e6, "1b": 1e9, "2b": 2e9,
                                                       "7b": 7e9}[size], rel_tol=0.05)


def test_the_8b_config_is_maxtext_recipes_model_and_sequence():
    """tpu256_8b is the shape of MaxText's published Llama 3.1 8B recipe (bench/maxtext_anchor.py compares
    the two steps): 8.03B parameters, Llama 3's vocabulary, 8,192 positions, on 256 chips."""
    cfg = config.load_config("tpu256_8b", ["+paths.model_name=check"])
    validate_config(cfg, cfg.mesh.d * cfg.mesh.t * cfg.mesh.c, max_token_id=128255, weights=train.Model)
    assert (cfg.model.vocab, cfg.training.tokens.len, cfg.mesh.d * cfg.mesh.t * cfg.mesh.c) == (128256, 8192, 256)
    assert math.isclose(llama_parameters(cfg.model), 8.03e9, rel_tol=0.005)


@pytest.mark.slow
def test_compare_commits_times_a_commit_against_this_checkout():
    """bench/compare_commits.py imports a commit's train.py with that commit's own modules, next
    to this checkout's, and alternates their steps: against HEAD it prints both step times, the
    ratio and both memories. The base's missing keys are dropped (HEAD has them all, so none here)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    command = [sys.executable, "-m", "bench.compare_commits", "--base", "HEAD", "--rounds", "2", "--",
               *TINY_ONE_DEVICE.split()]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert re.search(r"step time median: base \(HEAD\) \d+ ms, this checkout \d+ ms", result.stdout), result.stdout
    ratio = float(re.search(r"median ratio this/base over 2 alternating rounds: ([\d.]+)", result.stdout).group(1))
    assert 0.2 < ratio < 5, ratio  # the same code on both sides
    assert "dropped" not in result.stdout
    assert re.search(r"XLA temporary memory per device: base [\d.]+ MiB, this checkout [\d.]+ MiB", result.stdout)


def test_compare_commits_runs_the_base_in_its_own_tree(tmp_path):
    """The base side imports the base commit's train.py and package, from the tree unpacked for it,
    not this checkout's (which the editable install would otherwise give every process)."""
    compare_commits.unpack("HEAD", str(tmp_path / "base"))
    side = compare_commits.Side("base", str(tmp_path / "base"), {}, str(tmp_path / "no-batch.npz"))
    side.process.kill()
    side.process.wait()
    assert side.files["train"] == str(tmp_path / "base" / "train.py")
    assert side.files["make_mesh"].startswith(str(tmp_path / "base" / "seqax") + os.sep), side.files


@pytest.mark.slow
def test_compare_commits_names_a_commit_that_does_not_exist():
    result = subprocess.run([sys.executable, "-m", "bench.compare_commits", "--base", "no-such-commit"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "cannot read train.py at 'no-such-commit'" in result.stderr


def test_throughput_takes_its_child_along_when_terminated():
    """SIGTERM to bench/throughput.py while a config runs ends the child process too (on a GPU
    an orphan would keep its memory)."""
    command = [sys.executable, "-m", "bench.throughput", "--config", "local_test_synthetic", "--steps", "100000", "--",
               *TINY_ONE_DEVICE.split()]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    parent = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def children_of(pid: int) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        return found

    deadline = time.monotonic() + 60
    while not children_of(parent.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    [child] = children_of(parent.pid)
    parent.terminate()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}"), "the child outlived its parent"


# Memory per device of each accelerator the ladder is sized for: an H200 (139 GiB usable) and a
# TPU v6e chip (32 GB).
DEVICE_MEMORY = {"gpu": 139 * 2**30, "tpu": 32e9}


@pytest.mark.parametrize("name", LADDER)
def test_ladder_config_fits_its_accelerator(name):
    """memory.py's estimate per device (what the code's annotations say it holds, from shapes
    alone, with Muon's buffers added to the activations' peak although they exist only after it:
    an upper bound) is within 90% of the device's memory, the bound the ladder's batches are
    chosen under by the device's own compiler (README; gpu1_1b's estimate 120 GiB where its
    compiler plans 111). A model edit that keeps the sizes keeps this true; one that grows them
    past it fails here."""
    cfg = config.load_config(name, ["+paths.model_name=memory"])
    terms, *_ = memory.accelerator_estimate(cfg, memory.config_mesh(cfg))
    estimate = sum(size for _, size in terms)
    assert estimate <= 0.9 * DEVICE_MEMORY[name[:3]], (name, estimate / 2**30)


# ---------------------------------------------------------------------------------------------
# bench/mesh_agreement.py: the same steps on several meshes, each relative to the first.


def test_mesh_agreement_table_gives_each_steps_gap_against_the_first_mesh():
    runs = {(1, 1, 1): [{"loss": 2.0, "expert_load": 1.5}, {"loss": 1.0, "expert_load": 1.25}],
            (4, 2, 1): [{"loss": 2.002, "expert_load": 1.5}, {"loss": 0.99, "expert_load": 1.0}],
            (8, 1, 1): [{"loss": 1.999, "expert_load": 1.5}, {"loss": 1.0, "expert_load": 1.25}]}
    assert mesh_agreement.table(3, runs).splitlines() == [
        "seed 3: 1x1x1's losses 2.000000 1.000000",
        "  |loss / 1x1x1's - 1| at steps 0-1 | expert load",
        "    1x1x1  0.0e+00 0.0e+00  | 1.500 1.250",
        "    4x2x1  1.0e-03 1.0e-02  | 1.500 1.000",
        "    8x1x1  5.0e-04 0.0e+00  | 1.500 1.250",
        "  largest  1.0e-03 1.0e-02"]
    reversed_run = [{"loss": 2.0002, "expert_load": 1.5}, {"loss": 1.003, "expert_load": 1.375}]
    assert mesh_agreement.table(3, runs, reversed_run).splitlines()[-2:] == [
        "  largest  1.0e-03 1.0e-02",  # over the meshes only
        "  1x1x1, rows reversed  1.0e-04 3.0e-03  | 1.500 1.375"]


@pytest.mark.slow
def test_mesh_agreement_runs_each_seed_on_each_mesh(default_dataset, capsys):
    """Two seeds on 1x1x1 and 4x2x1, 2 steps of the tiny model, with the rows-reversed control: per seed
    the reference's losses (the seeds differ: they reach the weights and the batches), its row all 0, and
    step 0 (before any update) of 4x2 and of the reversed rows within test_optimizer's 1e-5, and some gap
    of the reversed rows not exactly 0 (their sums did run in another order; at step 0 the loss's sum may
    not see it: a sum taken as a balanced tree is the same backwards). Later steps' gaps are what the tool
    measures, not bounded here: at the tiny model's 128 tokens a step they reached 1.8e-4 (1x8, seed 0)."""
    mesh_agreement.main(["--meshes", "1x1x1", "4x2x1", "--steps", "2", "--seeds", "0", "1", "--rows-reversed",
                         "--", *TINY, f"dataset.path={default_dataset}"])
    seeds = capsys.readouterr().out.strip().split("\nseed ")
    assert len(seeds) == 2, seeds
    losses, reversed_gaps = [], []
    for text in seeds:
        header, _, one, four_two, largest, reversed_rows = text.splitlines()
        losses.append([float(x) for x in header.split("losses ")[1].split()])
        assert one.split() == ["1x1x1", "0.0e+00", "0.0e+00", "|", "0.000", "0.000"], one
        assert four_two.split()[0] == "4x2x1" and float(four_two.split()[1]) <= 1e-5, four_two
        assert largest.split()[1:] == four_two.split()[1:3], (largest, four_two)
        assert reversed_rows.split()[:3] == ["1x1x1,", "rows", "reversed"], reversed_rows
        reversed_gaps.append([float(g) for g in reversed_rows.split()[3:5]])
    assert len(losses[0]) == 2 and losses[0] != losses[1], losses
    assert all(g[0] <= 1e-5 for g in reversed_gaps) and any(max(g) > 0 for g in reversed_gaps), reversed_gaps


def test_mesh_agreement_refuses_a_bad_mesh_config_or_dataset_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        mesh_agreement.main(["--meshes", "4x2"])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "mesh '4x2' is not DxTxC" in err[-1], err
    moe = ["+model.experts=8", "+model.experts_per_token=2", "+model.expert_d_ff=32"]
    dataset = synthetic_dataset(tmp_path / "data.zarr", "--train-tokens", "10000", "--validation-tokens", "1000")
    ours = "bench.mesh_agreement: error: "
    for mesh, overrides, start, part in (  # each before any step is compiled
            ("3x1x1", [*moe, f"dataset.path={dataset}"], ours + "model.experts=8 is not divisible by mesh.d=3", ""),
            ("3x1x1", ["model.vocab=8", f"dataset.path={dataset}"], ours + "model.vocab=8 is too small for the", ""),
            ("3x1x1", ["dataset.path=/nonexistent/data.zarr"], ours, "/nonexistent/data.zarr"),
            ("16x1x1", [f"dataset.path={dataset}"], "mesh d=16 t=1 c=1 needs 16 devices, this machine has 8", "")):
        with pytest.raises(SystemExit) as refused:
            mesh_agreement.main(["--meshes", "1x1x1", mesh, "--", *overrides])
        line = str(refused.value.code)
        assert line.startswith(start) and part in line and "\n" not in line, line


def test_throughput_kills_a_child_whose_start_a_sigterm_interrupts(tmp_path, monkeypatch):
    """SIGTERM that arrives while Popen is still starting the child (before run_child holds it) waits until it
    does, then stops the run with the child killed; raised inside Popen, it left the child running (the test
    above, when its SIGTERM came that early, leaked a measure_step at full CPU)."""
    started = []

    def popen_then_sigterm(command, **kwargs):
        started.append(real_popen(["sleep", "60"], **kwargs))  # the child is running ...
        os.kill(os.getpid(), signal.SIGTERM)  # ... when SIGTERM comes, before Popen returns
        return started[-1]

    real_popen = subprocess.Popen
    monkeypatch.setattr(throughput.subprocess, "Popen", popen_then_sigterm)
    previous = signal.signal(signal.SIGTERM, throughput.stop)
    try:
        args = argparse.Namespace(steps=1, warmup=0, overrides=[], timeout=60)
        with pytest.raises(SystemExit) as stopped:
            throughput.run_child("local_test_synthetic", args, timeout=60)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert started and started[0].poll() == -signal.SIGKILL  # killed and reaped


def test_compile_for_lists_the_costliest_lines_with_their_layers_kernels_summed():
    """compile_for's costliest lines: the kernels that compute, summed by train.py's line and the JAX operation
    (an unrolled loop's layers each have their own kernels of one line, and the forward and backward theirs), the
    costliest first; a collective is not one of them (it runs on the links)."""
    def kernel(name, kind, function, line, op, seconds, runs=1.0):
        stack = [("/src/seqax/shardlib/shardops.py", "einsum_unreduced", 277), ("/src/train.py", function, line),
                 ("/src/train.py", "transformer_layer", 332)]
        return Kernel(name, "fusion", kind, runs, 1e9, 0.0, 1e6, seconds, False, stack, f"jit(step)/{op}")

    kernels = [kernel("fusion.1", "memory", "mlp_block", 265, "convert_element_type", 0.5e-3),
               kernel("fusion.2", "memory", "mlp_block", 265, "convert_element_type", 1.0e-3),
               kernel("fusion.3", "memory", "mlp_block", 265, "mul", 0.2e-3),
               kernel("gemm.1", "matmul", "mlp_block", 261, "dot_general", 0.3e-3, runs=3.0),
               kernel("all-gather.1", "collective", "mlp_block", 258, "all_gather", 5e-3)]
    lines = compile_for.costliest_lines(kernels, step_seconds=0.01)
    assert [(line["where"], line["op"]) for line in lines] == [
        ("train.py:mlp_block:265", "convert_element_type"), ("train.py:mlp_block:261", "dot_general"),
        ("train.py:mlp_block:265", "mul")]
    assert lines[0]["kernels"] == 2 and lines[0]["runs"] == 2 and lines[0]["seconds"] == pytest.approx(1.5e-3)
    assert lines[0]["share"] == pytest.approx(0.15) and lines[0]["gb"] == pytest.approx(2 * 1e6 / 1e9)
    assert lines[1]["runs"] == 3 and lines[1]["seconds"] == pytest.approx(0.9e-3) and lines[1]["kind"] == "matmuls"
    assert lines[1]["tflop"] == pytest.approx(3 * 1e9 / 1e12)
