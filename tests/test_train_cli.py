"""`python -m train` as a user runs it: the 50-step synthetic run learns, and bad configs stop
with one clear line before any compilation, leaving the disk as it was."""

import json
import os
import re
import subprocess
import sys

import pytest

import train
from fixtures import child_env, make_mesh, run_overrides, run_train, synthetic_dataset, tiny_overrides, train_args
from seqax.checkpoint import Checkpointer
from seqax.config import CheckpointError, SeqaxError, load_config

EARLIER_METRICS = '{"step": 0, "loss": 1.0}\n'  # an earlier run's file, which a bad config must leave alone


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> str:
    """The same tasks and tokens (so the same max_token_id), a two-hundredth of the size."""
    return synthetic_dataset(tmp_path_factory.mktemp("data") / "small.zarr", "--train-tokens", "20000",
                             "--validation-tokens", "3000")


@pytest.mark.slow
def test_local_test_synthetic_learns_in_50_steps(default_dataset, tmp_path):
    """On the dataset `make train` writes (the tool's defaults; tests/conftest.py). Without
    graphviz (fixtures.child_env): tests/test_startup_report.py checks the drawing, and drawing this
    step's graph outlasts the 30 s the run waits for it."""
    result = run_train(train_args(tmp_path, default_dataset, "smoke", "training.steps=50"), graph=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(l) for l in open(tmp_path / "smoke" / "metrics.jsonl")]
    evals = [l for l in lines if "eval_loss" in l]
    lines = [l for l in lines if "eval_loss" not in l]
    assert [l["step"] for l in lines] == list(range(50))
    assert ([l["step"] for l in evals] == [25, 50]  # eval_interval 25
            and evals[1]["eval_loss"] < evals[0]["eval_loss"]), evals
    for l in lines:
        assert {"step", "loss", "learning_rate", "grad_norm"} <= set(l)
    assert lines[0]["loss"] - lines[49]["loss"] >= 1.0, (lines[0]["loss"], lines[49]["loss"])
    config = (tmp_path / "smoke" / "config.yaml").read_text()
    assert "d_model: 256" in config and "model_name: smoke" in config


def earlier_run(tmp_path):
    run_dir = tmp_path / "bad"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(EARLIER_METRICS)
    return run_dir


def assert_untouched(run_dir):
    assert (run_dir / "metrics.jsonl").read_text() == EARLIER_METRICS
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["training.tokens.batch=62"], r"training.tokens.batch=62 is not divisible by mesh.d=4"),
        (["mesh.d=4", "mesh.t=4"], r"mesh.d=4 x mesh.t=4 = 16 must equal the 8 devices; choose mesh.d and mesh.t "
                                   r"whose product is 8, or run on 16 devices: on a CPU, set "
                                   r"XLA_FLAGS=--xla_force_host_platform_device_count=16 \(one process\) or use "
                                   r"`python -m tools.launch_local --processes P --devices-per-process K` "
                                   r"\(P x K = 16\)"),
        (["model.vocab=64"],
         r"model.vocab=64 is too small for the dataset's max_token_id \d+; set model.vocab to at least \d+"),
        (["model.n_kv=3"], r"model.n_kv=3 is not divisible by mesh.t=2"),
        (["model.attention_block=48"], r"model.attention_block=48 must divide training.tokens.len=64"),
        (["model.loss_parts=3"], r"model.loss_parts=3 must divide each device's positions, training.tokens.len / "
                                 r"mesh.c = 64"),
        (["dataset.path=/nonexistent/data.zarr"], r"dataset '/nonexistent/data.zarr' does not exist"),
        (["training.steps=ten"], r"config key training.steps must be int, got 'ten'"),
        (["checkpoint_interval=-5"],
         r"checkpoint_interval=-5 must be 0 \(save only at the end and on SIGTERM\) or a positive step count"),
        (["profile_steps=-1"], r"profile_steps=-1 must not be negative \(0 turns the profile off\)"),
    ],
)
def test_bad_config_stops_before_compiling(small_dataset, tmp_path, monkeypatch, overrides, message):
    """What `python -m train` runs (the config as hydra composes it, then train.train), in this
    process: each bad value stops it with a SeqaxError naming the value, before the step is
    compiled and before anything is written."""
    run_dir = earlier_run(tmp_path)

    def compile_step(*args):
        raise AssertionError("the training step was compiled despite a bad config")

    monkeypatch.setattr(train, "compile_step", compile_step)
    with pytest.raises(SeqaxError, match=message):
        cfg = load_config("local_test_synthetic", run_overrides(tmp_path, small_dataset, "bad", *overrides))
        train.train(cfg, "unused: true\n")
    assert_untouched(run_dir)


@pytest.mark.slow
def test_bad_config_on_the_command_line_is_one_line_on_stderr(small_dataset, tmp_path):
    """The command line's side of the contract: exit status 2, exactly one line on stderr
    starting with 'seqax: error: ', no step, and the run directory left as it was."""
    run_dir = earlier_run(tmp_path)
    result = run_train(train_args(tmp_path, small_dataset, "bad", "training.tokens.batch=62"))
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("seqax: error: ")
    assert re.search(r"training.tokens.batch=62 is not divisible by mesh.d=4", lines[0]), lines[0]
    assert "step" not in result.stdout  # no step ran
    assert_untouched(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("args,line", [
    (["training.stepz=5"], r"config local_test_synthetic has no key training\.stepz; did you mean training\.steps\?"),
    (["+training.stepz=5"], r"unknown config key training\.stepz; did you mean training\.steps\? \(known keys here: "),
    (["trainin.steps=5"], r"config local_test_synthetic has no key trainin; did you mean training\?"),
    (["--config-name=local_test_synthetc"],
     r"there is no config 'local_test_synthetc' in \S+configs; did you mean local_test_synthetic\? \(the configs: "),
    (["--config-name="], r"there is no config '' in \S+configs \(the configs: .*local_test_synthetic"),
    (["training.steps=["], r"cannot read the override 'training.steps=\[': .*; write overrides as key=value"),
    (["--config-path=configs", "training.stepz=5"],  # relative to the repository root, as when train.py ran hydra
     r"config local_test_synthetic has no key training\.stepz; did you mean training\.steps\?"),
], ids=["override", "addition", "section", "config_name", "empty_config_name", "grammar", "relative_config_path"])
def test_hydras_errors_are_one_line_naming_the_nearest_key(tmp_path, args, line):
    """Hydra's own report of these is several lines and exit status 1; the run directory is not made."""
    flags = [a for a in args if a.startswith("-")]  # hydra's parser takes its flags before the overrides
    command = [sys.executable, "-m", "train", "--config-name=local_test_synthetic", *flags, "+paths.model_name=run",
               f"paths.root_working_dir={tmp_path}", *[a for a in args if a not in flags]]
    result = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(rf"seqax: error: {line}.*", lines[0]), result.stderr
    assert not result.stdout and not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_no_config_name_is_one_line_naming_the_configs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "train", "+paths.model_name=run"], cwd=tmp_path, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "seqax: error: no config given: add --config-name=NAME, one of "
        + ", ".join(sorted(n[:-5] for n in os.listdir(os.path.join(os.path.dirname(train.__file__), "configs"))
                           if n.endswith(".yaml")))], result.stderr


@pytest.mark.parametrize("written_with", [pytest.param({}, marks=pytest.mark.slow, id="adamw_only"),
                                          pytest.param({k: v for k, v in train.MUON.items() if k != "w_q"},
                                                       id="muon_without_w_q")])
def test_a_checkpoint_of_other_optimizers_stops_the_resumed_run_with_one_line(small_dataset, tmp_path, monkeypatch,
                                                                             written_with):
    """A checkpoint written by the AdamW-only version (MUON = {}), or with another list of Muon
    weights, holds other optimizer state than this run's: resuming stops before anything is
    written, with one line naming the arrays that differ, and the checkpoint stays as it was."""
    cfg = load_config("local_test_synthetic", run_overrides(tmp_path, small_dataset, "resumed", *tiny_overrides()))
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t)
    checkpoints = tmp_path / "resumed" / "checkpoints"
    with monkeypatch.context() as patch:
        patch.setattr(train, "MUON", written_with)
        checkpointer = Checkpointer(str(checkpoints), cfg.checkpoints)
        checkpointer.save(2, train.init_state(cfg, mesh))
        checkpointer.close()
    before = {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError) as stopped:
        train.train(cfg, "unused: true\n")
    message = str(stopped.value)
    assert "\n" not in message and "does not hold this state" in message
    differing = ["muon_momentum.layers.w_q", "adam_mu.layers.w_q", "adam_nu.layers.w_q"]
    assert all(name in message for name in differing), message
    if written_with:  # only w_q's state differs
        assert "w_k" not in message, message
    assert {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == [".lock", "checkpoints"]
