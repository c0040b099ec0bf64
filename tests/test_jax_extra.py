"""jax_extra: explicit activation checkpointing keeps exactly what save_for_backward marks and
changes no value or gradient; a transformer layer keeps what its math needs; fold_in_str."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from fixtures import abstract_state, make_mesh, tiny_config
from seqax import memory
from seqax.jax_extra import SAVED_NAME, explicit_activation_checkpointing, fold_in_str, save_for_backward


def small_function(x):
    a = jnp.sin(x)
    b = save_for_backward(jnp.cos(a))
    return jnp.sum(jnp.exp(b) * a)


def test_only_marked_values_are_saved_in_a_small_function():
    lines = memory.saved_residuals(explicit_activation_checkpointing(small_function), jnp.ones(3))
    assert len(lines) == 2, lines
    assert "f32[3] from the argument x" in lines
    assert any(f"named '{SAVED_NAME}'" in line for line in lines), lines
    # Without the policy JAX would keep several intermediates: the marking is what decides.
    assert len(memory.saved_residuals(small_function, jnp.ones(3))) > 2


def test_checkpointing_changes_no_value_and_no_gradient():
    """Recomputing in the backward pass what was not saved gives the same numbers as keeping
    everything, and both equal the gradient written out by hand."""
    x = jnp.linspace(-2.0, 2.0, 7)
    value, grad = jax.value_and_grad(explicit_activation_checkpointing(small_function))(x)
    plain_value, plain_grad = jax.value_and_grad(small_function)(x)
    assert float(value) == float(plain_value)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(plain_grad))
    # d/dx [exp(cos(sin x)) sin x] = cos x [exp(cos(sin x)) (1 - sin(sin x) sin x)]
    a = np.sin(np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(grad),
                               np.cos(np.asarray(x, np.float64)) * np.exp(np.cos(a)) * (1 - np.sin(a) * a), rtol=1e-5)


def residual_shape(line: str) -> tuple[str, tuple[int, ...]]:
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
    return dtype, tuple(int(d) for d in dims.split(",") if d)


def test_transformer_layer_keeps_what_its_backward_pass_needs():
    """What one layer of the tiny model on a 4x2 mesh keeps for its backward pass, written from
    the model's math: every residual is the layer's input, a weight or a constant, or one of
    the values listed here; nothing else is kept and nothing listed is recomputed."""
    cfg = tiny_config()
    mesh = make_mesh(4, 2)
    B, L, M = cfg.training.tokens.batch // 4, cfg.training.tokens.len, cfg.model.d_model
    Q, K, D, F = cfg.model.n_q_per_kv, cfg.model.n_kv // 2, cfg.model.d_head, cfg.model.d_ff // 2
    N = L // cfg.model.attention_block
    with jax.set_mesh(mesh):
        layer = partial(train.training_layer, cfg.model)
        lines = memory.memory_annotations(cfg, mesh, abstract_state(cfg, mesh), layer, train.forward).saved
    saved = [residual_shape(l) for l in lines if f"named '{SAVED_NAME}'" in l]
    others = [l for l in lines if f"named '{SAVED_NAME}'" not in l]
    assert all(re.search(r"from (the argument|a constant)", l) for l in others), others
    # the residual stream as the layer gets it
    x = residual_shape(next(l for l in others if l.endswith("from the argument x")))
    # bfloat16 values are kept as their 16 bits (jax_extra: XLA:CPU widens a bf16 stack's update).
    expected = [
        ("u16", (B, L, M)),  # the attention's normalized input: the q, k and v projections' weight gradients
        # q, k (after RoPE) and v as the attention kernel's head blocks [B, N, K, (Q,) block, D]
        ("u16", (B, N, K, Q, cfg.model.attention_block, D)),  # q, for the gradients of k
        ("u16", (B, N, K, cfg.model.attention_block, D)),  # k, for the gradients of q
        ("u16", (B, N, K, cfg.model.attention_block, D)),  # v, for the gradients of the softmax weights
        ("u16", (B, L, Q, K, D)),  # the attention's output: the out projection's weight gradient
        # the log-sum-exp of every query's scores, to rebuild the softmax
        ("f32", (N, B, K, Q, cfg.model.attention_block)),
        x,  # the residual stream after attention: the FFN norm's gradient
        ("u16", (B, L, M)),  # the FFN's normalized input: the gate and up weight gradients
        ("u16", (B, L, F)),  # gate, for silu's gradient
        ("u16", (B, L, F)),  # up
    ]
    assert sorted(saved) == sorted(expected)


PINNED_EMBED_KEY = [4081611562, 4053798224]  # fold_in_str(key(0), "embed"), recorded once


def test_fold_in_str_is_stable_and_distinct():
    key = jax.random.key(0)
    a = jax.random.key_data(fold_in_str(key, "w_q"))
    assert np.array_equal(a, jax.random.key_data(fold_in_str(key, "w_q")))
    assert not np.array_equal(a, jax.random.key_data(fold_in_str(key, "w_k")))
    assert not np.array_equal(a, jax.random.key_data(fold_in_str(jax.random.key(1), "w_q")))
    # Pinned: sha256-based, so it cannot change with Python's hash seed or between processes.
    assert jax.random.key_data(fold_in_str(jax.random.key(0), "embed")).tolist() == PINNED_EMBED_KEY


@pytest.mark.parametrize("names", [("w_q", "w_k"), ("embed", "unembed"), ("a", "b")])
def test_fold_in_str_draws_are_uncorrelated(names):
    """Weights drawn from keys of different names are independent: their sample correlation is
    within a few standard errors of 0 (1 / sqrt(n) for n draws)."""
    n = 20_000
    a, b = (np.asarray(jax.random.normal(fold_in_str(jax.random.key(0), name), (n,))) for name in names)
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(n)
