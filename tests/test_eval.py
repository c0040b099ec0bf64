"""Validation loss during training: eval_loss lines at the right steps, the same values after a
restart on another mesh, and equal to the reference loss (tests/reference.py) of the same
validation batches."""

import json
import shutil

import jax
import numpy as np
import pytest

import train
from fixtures import make_mesh, reference_config, run_train, synthetic_dataset, tiny_config, tiny_overrides, train_args
from reference import loss as reference_loss
from reference import weights_to_dicts
from seqax import runs
from seqax.data_loader import make_loader
from seqax.flat_tokens import open_flat_tokens

pytestmark = pytest.mark.slow  # two training runs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic.zarr", "--train-tokens", "20000",
                             "--validation-tokens", "3000")


def overrides(d: int, t: int) -> list[str]:
    return tiny_overrides("model.n_kv=2", "dataset.streams=1", "training.steps=6", "checkpoint_interval=2",
                          "checkpoints.keep=0", "eval_interval=4", "eval_batches=2", f"mesh.d={d}", f"mesh.t={t}")


def train_on(dataset: str, root, d: int, t: int):
    """`python -m train` on a (d, t) mesh, in a child process (profiler, threads and all; no
    training_step.svg, which nothing here reads: fixtures.child_env)."""
    result = run_train(train_args(root, dataset, "eval", *overrides(d, t)), graph=False)
    assert result.returncode == 0, result.stderr[-3000:]


def eval_lines(run_dir) -> list[dict]:
    return [line for line in map(json.loads, open(run_dir / "metrics.jsonl")) if "eval_loss" in line]


def test_eval_loss_steps_restart_mesh_and_reference(dataset, tmp_path):
    train_on(dataset, tmp_path, 4, 2)
    run_dir = tmp_path / "eval"
    first = eval_lines(run_dir)
    assert [line["step"] for line in first] == [4, 6]  # every eval_interval steps and after the last

    # Restart from checkpoint 2 on another mesh: steps 2..5 run again, and so do both evaluations.
    for step in (4, 6):
        shutil.rmtree(run_dir / "checkpoints" / f"{step:010d}")
    train_on(dataset, tmp_path, 8, 1)
    again = eval_lines(run_dir)[2:]
    assert [line["step"] for line in again] == [4, 6]
    for a, b in zip(first, again):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4 * abs(a["eval_loss"]), (a, b)

    # The final weights' eval_loss is the mean loss of validation batches 0 and 1, by the reference.
    cfg8 = tiny_config(f"dataset.path={dataset}", *overrides(8, 1))
    mesh = make_mesh(8, 1)
    step, weights = runs.load_weights(str(run_dir), runs.load_run_config(str(run_dir)), mesh,
                                    train.init_weights, train.Model)
    assert step == 6
    loader = make_loader(cfg8.dataset, open_flat_tokens(dataset), "validation", cfg8.training.tokens.batch,
                         cfg8.training.tokens.len, mesh)
    batches = [jax.device_get(vars(loader.batch(i))) for i in range(2)]
    loader.close()
    reference_cfg = reference_config(cfg8.model)
    weights = weights_to_dicts(jax.device_get(weights), cfg8.model.layers)
    losses = [jax.jit(lambda w, b=b: reference_loss(w, reference_cfg, b["targets"], b["is_seq_start"],
                                                    b["loss_mask"]))(weights) for b in batches]
    expected = float(np.mean(losses))
    assert abs(again[1]["eval_loss"] - expected) <= 1e-4 * expected, (again[1]["eval_loss"], expected)
