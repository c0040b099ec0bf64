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
from seqax.analysis import memory
from seqax.jax_extra import SAVED_NAME, explicit_activation_checkpointing, fold_in_str, save_for_backward
from seqax.kernels import attention
from seqax.shardlib.shardops import FLOAT8_OPERAND_NAME


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


def test_transformer_layer_keeps_exactly_what_it_marks(monkeypatch):
    """What one layer of the tiny model on a 4x2 mesh keeps for its backward pass is exactly what its code
    marks, read as the code runs: every value passed to save_for_backward (train.py) or save_in_forward_rule
    (the attention kernel), bfloat16 ones as their 16 bits; every other residual is the layer's input, a
    weight or a constant. So nothing marked is recomputed and nothing unmarked kept, whatever an edit marks."""
    marked = []

    def recording(save):
        def marking(x):
            if x.size:  # (the dense model's empty experts: nothing to keep)
                marked.append(("u16" if x.dtype == jnp.bfloat16 else "f32", tuple(x.shape)))
            return save(x)
        return marking

    monkeypatch.setattr(train, "save_for_backward", recording(train.save_for_backward))
    monkeypatch.setattr(attention, "save_in_forward_rule", recording(attention.save_in_forward_rule))
    cfg = tiny_config()
    mesh = make_mesh(4, 2)
    with jax.set_mesh(mesh):
        layer = partial(train.training_layer, cfg.model)
        lines = memory.memory_annotations(cfg, mesh, abstract_state(cfg, mesh), layer, train.forward).saved
    saved = [residual_shape(l) for l in lines if f"named '{SAVED_NAME}'" in l]
    others = [l for l in lines if f"named '{SAVED_NAME}'" not in l]
    assert all(re.search(r"from (the argument|a constant)", l) for l in others), others
    assert len(saved) >= 8, saved  # the norms' inputs, q, k, v, o, the log-sum-exp, the stream, the MLP's
    assert sorted(saved) == sorted(marked), (saved, marked)


def test_a_float8_layer_keeps_its_activations_as_float8_casts():
    """In float8 each einsum of the layer keeps its first operand (the activations: the normed stream, the
    attention's output, the SwiGLU's hidden values) as the e4m3 cast the forward multiplied, one byte an element,
    with its inverse scale: the backward multiplies the same values without casting them again, and keeps no
    bfloat16 copy of what only those einsums needed (the MLP's normed input, which bf16 keeps). The memory
    estimate counts them all."""
    cfg = tiny_config("model.matmul_dtype=float8")
    mesh = make_mesh(4, 2)
    with jax.set_mesh(mesh):
        lines = {dtype: memory.memory_annotations(config, mesh, abstract_state(config, mesh),
                                                  partial(train.training_layer, config.model), train.forward).saved
                 for dtype, config in (("float8", cfg), ("bfloat16", tiny_config()))}
    B, L, M, F = cfg.training.tokens.batch // 4, cfg.training.tokens.len, cfg.model.d_model, cfg.model.d_ff // 2
    Q, K, D = cfg.model.n_q_per_kv, cfg.model.n_kv // 2, cfg.model.d_head
    casts = [residual_shape(line) for line in lines["float8"] if f"named '{FLOAT8_OPERAND_NAME}'" in line]
    arrays = sorted(shape for dtype, shape in casts if dtype == "u8")
    assert arrays == sorted([(B, L, M)] * 5 + [(B, L, Q, K, D), (B, L, F)]), casts  # q k v gate up; o; down
    assert [shape for dtype, shape in casts if dtype == "f32"] == [()] * 7, casts  # each cast's inverse scale
    saved_bf16 = {kind: [residual_shape(line)[1] for line in lines[kind]
                         if f"named '{SAVED_NAME}'" in line and line.startswith("u16")] for kind in lines}
    saved_bf16["bfloat16"].remove((B, L, M))  # the MLP's normed input
    assert sorted(saved_bf16["float8"]) == sorted(saved_bf16["bfloat16"]), saved_bf16
    kept = memory.layer_saved_values(lines["float8"])
    assert sorted(size for _, size, why in kept if why.startswith("float8")) == sorted(
        [B * L * M] * 5 + [B * L * Q * K * D, B * L * F] + [4] * 7)


def test_the_estimate_counts_a_float8_cast_kept_in_its_own_type():
    """On a GPU or a TPU a float8 einsum keeps its cast as float8 (on CPUs as its bits, u8, as above), which JAX
    writes f8_e4m3fn: one byte an element, counted as such (the estimate left every such cast out, 1.2 GiB a
    layer of gpu8_1b, so that it fell 3% under the H200 compiler's plan). A type of no known size is an error."""
    line = f"f8_e4m3fn[4,64,256] named '{FLOAT8_OPERAND_NAME}' from shardops.py:277:11 (einsum_unreduced)"
    assert memory.residual_size(line) == ("f8_e4m3fn[4,64,256]", 4 * 64 * 256)
    assert memory.layer_saved_values([line, line.replace("e4m3fn", "e5m2")]) == [
        ("f8_e4m3fn[4,64,256]", 4 * 64 * 256, "float8 einsum operand"),
        ("f8_e5m2[4,64,256]", 4 * 64 * 256, "float8 einsum operand")]
    assert memory.residual_size("bf16[4,64] named 'x'")[1] == 4 * 64 * 2
    with pytest.raises(ValueError, match="unknown element type 'float7'"):
        memory.residual_size(f"float7[4] named '{FLOAT8_OPERAND_NAME}'")


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
