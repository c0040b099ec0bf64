"""memory.py: the estimate per device follows what the code marks with save_for_backward."""

from functools import partial

import jax

import train
from fixtures import abstract_state, make_mesh, tiny_config
from seqax import memory
from seqax.jax_extra import save_for_backward


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
