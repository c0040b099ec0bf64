"""memory.py: the estimate per device follows what the code marks with save_for_backward and the weights
it gathers."""

import dataclasses
import math
from functools import partial

import jax
import pytest

import train
from fixtures import abstract_state, make_mesh, tiny_config
from seqax import memory
from seqax.jax_extra import save_for_backward
from seqax.shardlib.shardtypes import leaf_dims


def test_memory_report_follows_save_for_backward(monkeypatch):
    """A value marked with save_for_backward shows up in the estimate by itself. Here the
    sigmoid of the SwiGLU gate (float32 [B/d, L, F/t], which the backward pass needs and
    otherwise recomputes) is marked too."""
    cfg = tiny_config()
    mesh = make_mesh(4, 2)
    state = abstract_state(cfg, mesh)
    with jax.set_mesh(mesh):
        # A new function object each time: JAX caches the trace of a checkpointed function by its identity.
        before = memory.memory_estimate(state, memory.memory_annotations(
            cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward), train.MUON)
        sigmoid = jax.nn.sigmoid
        monkeypatch.setattr(jax.nn, "sigmoid", lambda x: save_for_backward(sigmoid(x)))
        after = memory.memory_estimate(state, memory.memory_annotations(
            cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward), train.MUON)
    saved = lambda terms: next(size for name, size in terms[0] if name.startswith("saved for backward"))  # noqa: E731
    B, L, F = cfg.training.tokens.batch // 4, cfg.training.tokens.len, cfg.model.d_ff // 2
    assert saved(after) - saved(before) == B * L * F * 4 * cfg.model.layers
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
    m = cfg.model
    M, Q, K, D, F, E, H = m.d_model, m.n_q_per_kv, m.n_kv // t, m.d_head, m.d_ff // t, m.experts, m.expert_d_ff
    gathered = 2 * M * Q * K * D + 2 * M * K * D + 3 * M * F + 3 * (E // d) * M * H  # q, o; k, v; SwiGLU; experts
    # Used as stored: every weight of the layer that no mesh axis splits (the norms, the router, the experts'
    # bias, and any gain an edit adds), read off the annotations: their sizes from init_weights.
    shapes = jax.eval_shape(lambda: train.init_weights(m, jax.random.key(0))).layers
    as_stored = sum(math.prod(getattr(shapes, f.name).shape[1:]) for f, dims in
                    zip(dataclasses.fields(train.Layer), leaf_dims(train.Layer)) if not any(x.axes for x in dims))
    assert layer.weight_bytes == 6 * gathered + 8 * as_stored
    outside = 6 * M * (m.vocab // t)  # the embedding and the unembedding: V split over t, M gathered over d
    assert dict(terms)["largest gathered weights of one layer: bf16, f32 gradient"] == max(layer.weight_bytes,
                                                                                            outside)
