"""Divergence is a fault (docs/reliability.md, "Divergence"): a run whose loss or gradient norm is not
finite stops at that step with one line and a non-zero exit, saves no state past it, keeps the newest
checkpoint whose loss was finite (also with checkpoints.keep=1), and resumes from it at a lower rate."""

import json
import math
import os
import re

import numpy as np
import pytest
import zarr

from fixtures import run_train, synthetic_dataset, tiny_overrides, train_args


def finite_arrays(checkpoint: str) -> bool:
    """Whether every array of a checkpoint (its stored values, read with zarr) is finite."""
    group = zarr.open_group(checkpoint, mode="r")
    arrays = [group[name][...] for name in group.attrs["arrays"]]
    return all(np.isfinite(a).all() for a in arrays if a.dtype.kind == "f")


@pytest.mark.slow  # two training runs in child processes (about 60 s)
def test_a_run_at_learning_rate_1e6_stops_with_one_line_and_resumes_from_the_last_finite_checkpoint(tmp_path):
    dataset = synthetic_dataset(tmp_path / "data.zarr")
    overrides = tiny_overrides("training.learning_rate=1e6", "training.steps=12", "checkpoint_interval=1",
                               "checkpoints.keep=1", "eval_batches=0")
    result = run_train(train_args(tmp_path, dataset, "run", *overrides), graph=False)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.strip().splitlines() if not line.startswith("seqax: warning: ")]
    assert len(errors) == 1, errors  # (graph=False: the warning that graphviz is missing)
    match = re.fullmatch(
        r"seqax: error: step (\d+)'s loss is \S+ and its grad_norm \S+: training diverged, and stops before saving "
        r"a state past it; checkpoint \1, whose state gave it, is set aside as (\S+); checkpoint (\d+) is the newest "
        r"whose loss was finite: lower training.learning_rate \(or muon_learning_rate, or raise warmup_steps\) and "
        r"run the same command to resume from it", errors[0])
    assert match, errors[0]
    step, aside, kept = int(match[1]), match[2], int(match[3])
    assert kept == step - 1 and os.path.basename(aside).startswith(f".diverged.{step:010d}.")

    run = tmp_path / "run"
    lines = {line["step"]: line for line in map(json.loads, open(run / "metrics.jsonl"))}
    assert max(lines) == step  # no step after the one that diverged
    assert not (math.isfinite(lines[step]["loss"]) and math.isfinite(lines[step]["grad_norm"]))
    assert all(math.isfinite(lines[s]["loss"]) and math.isfinite(lines[s]["grad_norm"]) for s in range(step))
    # keep=1, and yet the newest checkpoint whose loss was finite is there, whole, beside the diverged one set aside
    assert sorted(os.listdir(run / "checkpoints")) == sorted([f"{kept:010d}", os.path.basename(aside)])
    assert finite_arrays(str(run / "checkpoints" / f"{kept:010d}"))

    # What the line says: a lower rate and the same command resume from checkpoint `kept` and train on.
    lower = [*overrides, "training.learning_rate=1e-2", f"training.steps={step + 2}"]
    again = run_train(train_args(tmp_path, dataset, "run", *lower), graph=False)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [json.loads(line) for line in open(run / "metrics.jsonl")][len(lines):]
    assert [line["step"] for line in resumed] == list(range(kept, step + 2))
    assert all(math.isfinite(line["loss"]) for line in resumed)
