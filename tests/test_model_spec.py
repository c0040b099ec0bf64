"""docs/model.md is the model: its NumPy code blocks, executed here in float64, give the logits and
the loss of train.py (float32 matmuls) on packed documents, so the page cannot drift from the code."""

import os
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import train
from fixtures import make_mesh, tiny_config
from shardlib.shardtypes import bool_, f32, make_shardings, typed_shard_map, u32

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "model.md")


@pytest.fixture(scope="module")
def spec() -> dict:
    """The names defined by the ```python blocks of docs/model.md, run in order."""
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.DOTALL | re.MULTILINE)
    namespace: dict = {}
    exec(compile("\n".join(blocks), DOC, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def problem():
    """Tiny config, weights with norm gains away from 1 (so that w vs 1 + w shows), and a batch
    of packed documents: several per row, rows 1 and 5 starting mid-document, padding (target 0,
    a start of its own, masked out) at the end of rows 2 and 6."""
    cfg = tiny_config()
    w = train.init_weights(cfg.model, jax.random.key(0))
    gains = lambda x, seed: x + 0.3 * jax.random.normal(jax.random.key(seed), x.shape)  # noqa: E731
    layers = train.Layer(**{**vars(w.layers), "attn_norm": gains(w.layers.attn_norm, 1),
                            "ffn_norm": gains(w.layers.ffn_norm, 2)})
    weights = jax.device_get(train.Model(w.embed, layers, gains(w.final_norm, 3), w.unembed))
    B, L, V = cfg.training.tokens.batch, cfg.training.tokens.len, cfg.model.vocab
    rng = np.random.default_rng(0)
    targets = rng.integers(1, V, size=(B, L)).astype(np.uint32)
    starts = np.zeros((B, L), bool)
    for row, cuts in enumerate([[0, 5, 11], [7], [0, 3, 9], [0, 1, 2, 15], [0], [4, 10], [0, 8], [0, 6, 12]]):
        starts[row, cuts] = True
    mask = np.ones((B, L), bool)
    mask[[2, 6], -4:] = False
    targets[~mask], starts[~mask] = 0, True
    return cfg, weights, (targets, starts, mask)


def as_dict(model: train.Model) -> dict:
    """The weights by name, float64, as docs/model.md reads them."""
    named = {**vars(model.layers), "embed": model.embed, "final_norm": model.final_norm, "unembed": model.unembed}
    return {name: np.asarray(x, np.float64) for name, x in named.items()}


def ours(cfg, mesh, weights, batch):
    """train.forward's logits and train.model_loss's loss, float32 matmuls, on `mesh`."""
    targets, starts, mask = batch

    @typed_shard_map
    def on_device(w: train.Model, targets: u32[b"B/d L/c"], starts: bool_[b"B/d L/c"],
                  mask: bool_[b"B/d L/c"]) -> tuple[f32[b"B/d L/c V/t"], f32[b""]]:
        inputs = jnp.where(starts, 0, jnp.pad(targets[:, :-1], ((0, 0), (1, 0))))
        return (train.forward(cfg.model, w, inputs, starts),
                lax.psum(train.model_loss(cfg.model, w, targets, starts, mask), ("d", "c")))

    with jax.set_mesh(mesh):
        w = jax.device_put(weights, make_shardings(train.Model, mesh))
        put = partial(jax.device_put, device=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None)))
        logits, loss = jax.jit(on_device)(w, put(targets), put(starts), put(mask))
    return np.asarray(logits, np.float64), float(loss)


@pytest.mark.parametrize("d,t", [(1, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_numpy_model_of_the_doc_gives_our_logits_and_loss(spec, problem, d, t, monkeypatch):
    cfg, weights, (targets, starts, mask) = problem
    monkeypatch.setattr(train, "MATMUL_DTYPE", jnp.float32)
    logits, loss = ours(cfg, make_mesh(d, t), weights, (targets, starts, mask))
    w, base, eps = as_dict(weights), cfg.model.rope_base, cfg.model.norm_eps
    inputs = spec["model_inputs"](targets.astype(np.int64), starts)
    want_logits = spec["forward"](w, inputs, starts, base, eps)
    want_loss = spec["loss"](w, targets.astype(np.int64), starts, mask, base, eps)
    error = np.max(np.abs(logits - want_logits)) / np.max(np.abs(want_logits))
    print(f"mesh {d}x{t}: max |logit error| / max |logit| = {error:.2e}; loss {loss:.6f} vs {want_loss:.6f}")
    assert error < 1e-5
    assert loss == pytest.approx(want_loss, rel=1e-5)


def test_the_doc_model_notices_a_wrong_convention(spec, problem):
    """The check has teeth: the doc's model with 1 + w norms, or without the document mask,
    is far outside the tolerance."""
    cfg, weights, (targets, starts, mask) = problem
    w, base, eps = as_dict(weights), cfg.model.rope_base, cfg.model.norm_eps
    inputs = spec["model_inputs"](targets.astype(np.int64), starts)
    right = spec["forward"](w, inputs, starts, base, eps)
    one_plus = {name: x + 1 if name.endswith("norm") else x for name, x in w.items()}
    one_row_one_doc = np.zeros_like(starts)
    for wrong in (spec["forward"](one_plus, inputs, starts, base, eps),
                  spec["forward"](w, inputs, one_row_one_doc, base, eps)):
        assert np.max(np.abs(wrong - right)) / np.max(np.abs(right)) > 1e-2
