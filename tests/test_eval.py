"""Validation loss during training: eval_loss lines at the right steps, the same values after a
restart on another mesh, and equal to the reference loss (tests/reference.py) of the same
validation batches."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from omegaconf import OmegaConf

import config
import train
from data_loader import make_loader
from flat_tokens import open_flat_tokens
from model_fixtures import make_mesh, tiny_config
from reference import loss as reference_loss
from reference import weights_to_dicts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("data") / "synthetic.zarr")
    cmd = [sys.executable, "-m", "tools.write_synthetic_dataset", "--output", path, "--train-tokens", "20000", "--validation-tokens", "3000"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return path


def config(dataset: str, root, d: int, t: int) -> config.Config:
    return tiny_config(
        "model.n_kv=2", f"dataset.path={dataset}", "dataset.streams=1", f"paths.root_working_dir={root}", "paths.model_name=eval",
        "training.steps=6", "checkpoint_interval=2", "checkpoints.keep=0", "eval_interval=4", "eval_batches=2", f"mesh.d={d}", f"mesh.t={t}",
    )


def eval_lines(run_dir) -> list[dict]:
    return [line for line in map(json.loads, open(run_dir / "metrics.jsonl")) if "eval_loss" in line]


def test_eval_loss_steps_restart_mesh_and_reference(dataset, tmp_path):
    h = config(dataset, tmp_path, 4, 2)
    train.train(h, OmegaConf.to_yaml(dataclasses.asdict(h)))
    run_dir = tmp_path / "eval"
    first = eval_lines(run_dir)
    assert [line["step"] for line in first] == [4, 6]  # every eval_interval steps and after the last

    # Restart from checkpoint 2 on another mesh: steps 2..5 run again, and so do both evaluations.
    for step in (4, 6):
        shutil.rmtree(run_dir / "checkpoints" / f"{step:010d}")
    h8 = config(dataset, tmp_path, 8, 1)
    state = train.train(h8, OmegaConf.to_yaml(dataclasses.asdict(h8)))
    again = eval_lines(run_dir)[2:]
    assert [line["step"] for line in again] == [4, 6]
    for a, b in zip(first, again):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4 * abs(a["eval_loss"]), (a, b)

    # The final weights' eval_loss is the mean loss of validation batches 0 and 1, by the reference.
    loader = make_loader(h8.dataset, open_flat_tokens(dataset), "validation", h8.training.tokens.batch, h8.training.tokens.len, make_mesh(8, 1))
    batches = [jax.device_get(vars(loader.batch(i))) for i in range(2)]
    loader.close()
    cfg = {k: getattr(h8.model, k) for k in ("n_kv", "n_q_per_kv", "d_head", "rope_base", "norm_eps")}
    weights = weights_to_dicts(jax.device_get(state.weights), h8.model.layers)
    losses = [jax.jit(lambda w, b=b: reference_loss(w, cfg, b["targets"], b["is_seq_start"], b["loss_mask"]))(weights) for b in batches]
    expected = float(np.mean(losses))
    assert abs(again[1]["eval_loss"] - expected) <= 1e-4 * expected, (again[1]["eval_loss"], expected)
