"""`python -m train` as a user runs it: the 50-step synthetic run learns, and bad configs stop
with one clear line before any compilation, leaving the disk as it was."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*args: str, devices: int = 8, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    cmd = [sys.executable, "-m", "train", "--config-name=local_test_synthetic", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """The dataset `make train` writes (the tool's defaults)."""
    path = str(tmp_path_factory.mktemp("data") / "synthetic.zarr")
    subprocess.run([sys.executable, "-m", "tools.write_synthetic_dataset", "--output", path], cwd=ROOT, check=True, capture_output=True)
    return path


def test_local_test_synthetic_learns_in_50_steps(dataset, tmp_path):
    result = run_train("+paths.model_name=smoke", f"paths.root_working_dir={tmp_path}", f"dataset.path={dataset}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(l) for l in open(tmp_path / "smoke" / "metrics.jsonl")]
    evals = [l for l in lines if "eval_loss" in l]
    lines = [l for l in lines if "eval_loss" not in l]
    assert [l["step"] for l in lines] == list(range(50))
    assert [l["step"] for l in evals] == [25, 50] and evals[1]["eval_loss"] < evals[0]["eval_loss"], evals  # eval_interval 25
    for l in lines:
        assert {"step", "loss", "learning_rate", "grad_norm"} <= set(l)
    assert lines[0]["loss"] - lines[49]["loss"] >= 1.0, (lines[0]["loss"], lines[49]["loss"])
    config = (tmp_path / "smoke" / "config.yaml").read_text()
    assert "d_model: 256" in config and "model_name: smoke" in config


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["training.tokens.batch=62"], r"training.tokens.batch=62 is not divisible by mesh.d=4"),
        (["mesh.d=4", "mesh.t=4"], r"mesh.d=4 x mesh.t=4 = 16 must equal the 8 devices"),
        (["model.vocab=64"], r"model.vocab=64 is too small for the dataset's max_token_id \d+; set model.vocab to at least \d+"),
        (["model.n_kv=3"], r"model.n_kv=3 is not divisible by mesh.t=2"),
        (["model.attention_block=48"], r"model.attention_block=48 must divide training.tokens.len=64"),
        (["dataset.path=/nonexistent/data.zarr"], r"dataset '/nonexistent/data.zarr' does not exist"),
        (["training.steps=ten"], r"config key training.steps must be int, got 'ten'"),
        (["checkpoint_interval=-5"], r"checkpoint_interval=-5 must be 0 \(save only at the end and on SIGTERM\) or a positive step count"),
    ],
)
def test_bad_config_stops_with_one_line_before_compiling(dataset, tmp_path, overrides, message):
    run_dir = tmp_path / "bad"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')  # an earlier run's file
    result = run_train("+paths.model_name=bad", f"paths.root_working_dir={tmp_path}", f"dataset.path={dataset}", *overrides)
    assert result.returncode != 0
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("seqax: error: ")
    assert re.search(message, lines[0]), lines[0]
    assert "step" not in result.stdout  # no step ran
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0, "loss": 1.0}\n'
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl"]
