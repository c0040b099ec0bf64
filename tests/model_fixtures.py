"""A tiny config, meshes and batches shared by the model tests."""

import jax
import numpy as np

import config
import train
from config import load_config

# Every weight dimension that a mesh axis splits divides 8, so every mesh of 8 devices fits.
TINY = [
    "model.d_model=64", "model.n_q_per_kv=2", "model.n_kv=8", "model.d_head=8", "model.d_ff=128", "model.layers=2", "model.vocab=256",
    "model.attention_block=8",
    "training.tokens.batch=8", "training.tokens.len=16", "training.steps=20", "training.warmup_steps=4", "training.learning_rate=1e-2",
    "training.weight_decay=0.1", "+paths.model_name=test",
]


def tiny_config(*overrides: str) -> config.Config:
    return load_config("local_test_synthetic", TINY + list(overrides))


def make_mesh(d: int, t: int) -> jax.sharding.Mesh:
    return train.make_mesh(d, t, devices=jax.devices()[: d * t])


def random_batch(seed: int, batch: int, length: int, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Targets, document starts and loss mask with several documents per row; some rows start
    mid-document, and some end in padding (target 0, a start of its own, masked out) as the
    loader pads."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(1, vocab, size=(batch, length)).astype(np.uint32)
    starts = rng.random((batch, length)) < 0.2
    starts[::2, 0] = True
    mask = np.ones((batch, length), bool)
    mask[1::3, -3:] = False
    targets[~mask], starts[~mask] = 0, True
    return targets, starts, mask
