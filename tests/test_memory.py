"""memory.py: the estimate per device follows what the code marks with save_for_backward and the weights
it gathers."""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import pytest

import train
from fixtures import abstract_state, make_mesh, tiny_config
from seqax.analysis import memory
from seqax.jax_extra import save_for_backward
from seqax.shardlib.shardtypes import leaf_dims


def test_memory_report_follows_save_for_backward(monkeypatch):
    """A value marked with save_for_backward shows up in the estimate by itself. Here the MLP block's
    output (float32 [B/d, L, M], partial sums over t), whatever the block computes, is squared, so that the
    backward pass needs it, and marked: it is saved instead of computed again. (Marked but unsquared it
    would not be: the residual add and the reduce-scatter after it need nothing of it for backward.)"""
    cfg = tiny_config()
    mesh = make_mesh(4, 2)
    state = abstract_state(cfg, mesh)
    with jax.set_mesh(mesh):
        # A new function object each time: JAX caches the trace of a checkpointed function by its identity.
        before = memory.memory_estimate(state, memory.memory_annotations(
            cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward), train.MUON)
        mlp_block = train.mlp_block
        monkeypatch.setattr(train, "mlp_block", lambda *args: jnp.square(save_for_backward(mlp_block(*args))))
        after = memory.memory_estimate(state, memory.memory_annotations(
            cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward), train.MUON)
    saved = lambda terms: next(size for name, size in terms[0] if name.startswith("saved for backward"))  # noqa: E731
    B, L, M = cfg.training.tokens.batch // 4, cfg.training.tokens.len, cfg.model.d_model
    assert saved(after) - saved(before) == B * L * M * 4 * cfg.model.layers
    assert len(after[1]) == len(before[1]) + 1


@pytest.mark.parametrize("experts", [0, 8])
@pytest.mark.parametrize("d,t", [(4, 2), (8, 1), (1, 8), (1, 1)])
def test_the_gathered_weights_are_those_the_layer_gathers(experts, d, t):
    """The estimate's gathered weights of one layer are what the layer's code gathers, as train.py's
    specs say: the dense weights over d (FSDP), each kept split over t; the experts kept split over d
    (expert parallelism), their M gathered over t. 2 bytes a gathered element and 4 for its f32
    gradient; the weights used as stored (the norms, the router, the experts' bias) 4 + 4."""
    moe = ("+model.experts=8", "+model.experts_per_token=2", "+model.expert_d_ff=32", "+model.expert_block=8")
    cfg = tiny_config(*(moe if experts else ()))
    mesh = make_mesh(d, t)
    state = abstract_state(cfg, mesh)
    with jax.set_mesh(mesh):
        layer = memory.memory_annotations(cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward)
        terms, _ = memory.memory_estimate(state, layer, train.MUON)
    # The layer's weights read off their annotations, sizes from init_weights. The layer gathers a dimension
    # split over several axes (M/d/c, the experts' M/c/t: FSDP) whole and leaves one split over a single
    # axis split (K/t, F/t: tensor parallelism; E/d: expert parallelism); one that no axis splits (the norms,
    # the router, the experts' bias) it uses as stored.
    shapes = jax.eval_shape(lambda: train.init_weights(cfg.model, jax.random.key(0))).layers
    gathered = as_stored = 0
    for field, dims in zip(dataclasses.fields(train.Layer), leaf_dims(train.Layer), strict=True):
        sizes = getattr(shapes, field.name).shape[1:]
        if not any(x.axes for x in dims):
            as_stored += math.prod(sizes)
        else:
            gathered += math.prod(n // (mesh.shape[x.axes[0]] if len(x.axes) == 1 else 1) for n, x in zip(sizes, dims))
    assert layer.weight_bytes == 6 * gathered + 8 * as_stored
    M, V = cfg.model.d_model, cfg.model.vocab
    outside = 6 * M * (V // t)  # the unembedding: V split over t, M gathered over d; bf16 and its f32 gradient
    assert dict(terms)["largest gathered weights: one layer's (bf16, f32 gradient) or the unembedding's"] == max(
        layer.weight_bytes, outside)
