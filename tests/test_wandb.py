"""wandb_log.py through records.RunRecords, in W&B's offline mode (no network): the W&B run gets
the values of every metrics.jsonl line at its step and the resolved config, and a restart
resumes the same W&B run. What W&B wrote is read back from its own record files: a .wandb file
is a LevelDB-style log of protobuf records (wandb.proto.wandb_internal_pb2.Record), the same
that `wandb sync` uploads."""

import glob
import json
import os
import struct
import types

import jax.numpy as jnp
import pytest
import yaml
from wandb.proto import wandb_internal_pb2

import train
from seqax import config, wandb_log
from seqax.analysis import hardware
from seqax.records import RunRecords

CONFIG_YAML = "model:\n  d_model: 8\ntraining:\n  steps: 8\nlogging:\n  wandb_project: seqax-test\n  wandb_entity: ''\n"


def fake_config(steps: int):
    return types.SimpleNamespace(
        training=types.SimpleNamespace(steps=steps, tokens=types.SimpleNamespace(batch=4, len=8)),
        model=config.ModelConfig(d_model=8, n_q_per_kv=1, n_kv=1, d_head=8, d_ff=16, layers=1, vocab=16, rope_base=1e4,
                                 norm_eps=1e-5, attention_block=8),
        mesh=types.SimpleNamespace(d=1, t=1),
        logging=config.LoggingConfig(wandb_project="seqax-test", wandb_entity=""),
        profile_steps=0,
    )


def run_log(run_dir, start: int, losses: dict[int, float], evals: dict[int, float]):
    """RunRecords as train.py drives it: steps from `start`, an eval line after step s - 1 for each s in `evals`."""
    log = RunRecords(str(run_dir), CONFIG_YAML, fake_config(8), start, flops_per_token=1e6)
    for step, loss in losses.items():
        log.before_step(step, None)
        log.after_step(step, train.Metrics(jnp.float32(loss), jnp.float32(1e-3 * (step + 1)), jnp.float32(0.5 + step),
                                         jnp.float32(0.0)))
        if step + 1 in evals:  # as evaluation.Evaluation returns them, with a task's accuracies
            log.eval(step + 1, lambda token_losses, step=step: {
                "eval_loss": evals[step + 1], "lines/acc": 0.25 + 0.01 * step, "lines/acc_norm": 0.3}, None)
    log.close()


def records(path: str):
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB log blocks of 32 KiB holding chunks (crc32c, length, type: 1 full, 2 first, 3 middle,
    4 last); a block's tail shorter than a chunk header is padding."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def read_offline_run(run_dir: str) -> tuple[str, dict, dict[int, dict]]:
    """(run id, config, {step: values}) of one offline W&B run directory."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run_id, cfg, history = None, {}, {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            cfg |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "config":
            cfg |= {item.key: json.loads(item.value_json) for item in record.config.update}
        elif kind == "history":
            values = {item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                      for item in record.history.item}
            step = values.pop("_step")
            history.setdefault(step, {}).update({k: v for k, v in values.items() if not k.startswith("_")})
    return run_id, cfg, history


def start_order(directory: str) -> tuple[str, int]:
    """Sort key of an offline run directory, offline-run-<YYYYMMDD_HHMMSS>-<run id>[-<n>]: W&B adds
    -1, -2, ... when a start's directory name is already taken (two starts in one second)."""
    _, _, time, rest = os.path.basename(directory).split("-", 3)
    run_id, _, n = rest.partition("-")
    return time, int(n or 0)


def by_step(lines: list[dict]) -> dict[int, dict]:
    """metrics.jsonl lines merged per step, as W&B keeps them (a step's row gets every value logged at it)."""
    out = {}
    for line in lines:
        out.setdefault(line["step"], {}).update({k: v for k, v in line.items() if k != "step"})
    return out


@pytest.mark.slow  # two W&B offline runs (about 3 s)
def test_wandb_gets_the_metrics_lines_and_config_and_a_restart_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(hardware, "peak_flops", lambda: (1e12, "test"))
    run_dir = tmp_path / "run"
    run_log(run_dir, 0, {s: 5.0 - 0.25 * s for s in range(5)}, {3: 4.5})  # stopped after step 4; checkpoint 3
    run_id = (run_dir / wandb_log.RUN_ID_FILE).read_text().strip()
    first_lines = len(open(run_dir / "metrics.jsonl").readlines())
    run_log(run_dir, 3, {s: 6.0 - 0.5 * s for s in range(3, 8)}, {6: 3.25, 8: 2.75})
    assert (run_dir / wandb_log.RUN_ID_FILE).read_text().strip() == run_id

    lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert any("eval_loss" in line and "lines/acc" in line for line in lines)
    assert any(line.get("mfu") is not None for line in lines)
    starts = sorted(glob.glob(str(tmp_path / "wandb_dir" / "wandb" / f"offline-run-*-{run_id}*")), key=start_order)
    assert len(starts) == 2, starts  # one directory per process start, both of the one W&B run
    for directory, part in zip(starts, (lines[:first_lines], lines[first_lines:])):
        got_id, cfg, history = read_offline_run(directory)
        assert got_id == run_id
        assert history == by_step(part)  # the same values, bit for bit, at the same steps
        for key, value in yaml.safe_load(CONFIG_YAML).items():
            assert cfg[key] == value


def test_wandb_is_not_imported_when_off(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "peak_flops", lambda: (1e12, "test"))
    monkeypatch.setattr(wandb_log, "WandbLog", None)  # would fail if called
    cfg = fake_config(2)
    cfg.logging = config.LoggingConfig(wandb_project="", wandb_entity="")
    log = RunRecords(str(tmp_path), CONFIG_YAML, cfg, 0, flops_per_token=1e6)
    log.close()
    assert log.wandb is None and not (tmp_path / wandb_log.RUN_ID_FILE).exists()
