"""The sharded model against tests/reference.py on every mesh shape of 8 devices."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import reference
import train
from model_fixtures import make_mesh, random_batch, tiny_config
from reference import loss as reference_loss
from reference import weights_to_dicts
from shardlib.shardtypes import bool_, f32, make_shardings, typed_shard_map, u32

MESHES = [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8)]


def perturbed_weights(h) -> train.Model:
    """Initial weights with norm gains moved off 1, so that their gradients mean something."""
    w = train.init_weights(h.model, jax.random.key(0))
    key = jax.random.key(1)
    bump = lambda x, name: x + 0.2 * jax.random.normal(jax.random.fold_in(key, sum(map(ord, name))), x.shape)  # noqa: E731
    layers = train.Layer(**{**vars(w.layers), "attn_norm": bump(w.layers.attn_norm, "a"), "ffn_norm": bump(w.layers.ffn_norm, "f")})
    return train.Model(w.embed, layers, bump(w.final_norm, "n"), w.unembed)


@pytest.fixture(scope="module")
def problem():
    h = tiny_config()
    weights = jax.device_get(perturbed_weights(h))
    targets, starts, mask = random_batch(0, h.training.tokens.batch, h.training.tokens.len, h.model.vocab)
    cfg = {k: getattr(h.model, k) for k in ("n_kv", "n_q_per_kv", "d_head", "rope_base", "norm_eps")}
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda w: reference_loss(w, cfg, targets, starts, mask)))(weights_to_dicts(weights, h.model.layers))
    return h, weights, (targets, starts, mask), float(ref_loss), ref_grads


@pytest.fixture(scope="module")
def exact_reference(problem):
    """The reference's loss and gradients with float32 matmul operands: the exact math."""
    h, weights, (targets, starts, mask), *_ = problem
    cfg = {k: getattr(h.model, k) for k in ("n_kv", "n_q_per_kv", "d_head", "rope_base", "norm_eps")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "bf16", jnp.float32)
        loss, grads = jax.jit(jax.value_and_grad(lambda w: reference_loss(w, cfg, targets, starts, mask)))(weights_to_dicts(weights, h.model.layers))
    return float(loss), grads


def relative_errors(grads: dict, ref_grads: dict) -> list[tuple[str, float]]:
    """(path, relative L2 error) of every gradient in `grads` against `ref_grads` (reference dicts)."""
    flat_ref, flat = jax.tree_util.tree_flatten_with_path(ref_grads)[0], jax.tree.leaves(grads)
    assert len(flat_ref) == len(flat)
    return [
        (jax.tree_util.keystr(path), np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r, np.float64)) / np.linalg.norm(np.asarray(r, np.float64)))
        for (path, r), g in zip(flat_ref, flat)
    ]


def put_batch(mesh, batch):
    return jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None)))


def sharded_loss_and_grads(h, mesh, weights, batch):
    @typed_shard_map
    def on_device(w: train.Model, targets: u32[b"B/d L"], starts: bool_[b"B/d L"], mask: bool_[b"B/d L"]) -> tuple[f32[b""], train.Model]:
        loss, grads = jax.value_and_grad(partial(train.model_loss, h.model))(w, targets, starts, mask)
        return lax.psum(loss, "d"), grads

    with jax.set_mesh(mesh):
        w = jax.device_put(weights, make_shardings(train.Model, mesh))
        return jax.device_get(jax.jit(on_device)(w, *put_batch(mesh, batch)))


@pytest.mark.parametrize("d,t", MESHES)
def test_float32_loss_and_gradients_equal_reference_on_every_mesh(problem, exact_reference, d, t, monkeypatch):
    """With float32 matmul operands in both, the sharded model and the reference compute the
    same numbers up to the order of float32 sums: every sharding, mask, RoPE and attention
    block is checked to 1e-4 (bfloat16 rounding would hide errors below ~1e-2)."""
    h, weights, batch, *_ = problem
    exact_loss, exact_grads = exact_reference
    monkeypatch.setattr(train, "MATMUL_DTYPE", jnp.float32)
    loss, grads = sharded_loss_and_grads(h, make_mesh(d, t), weights, batch)
    assert abs(float(loss) - exact_loss) <= 1e-6 * abs(exact_loss), (float(loss), exact_loss)
    for path, err in relative_errors(weights_to_dicts(grads, h.model.layers), exact_grads):
        assert err < 1e-4, f"gradient {path}: relative L2 error {err:.2e} on mesh {d}x{t}"


@pytest.mark.parametrize("d,t", [(1, 1), (2, 4)])
def test_bfloat16_loss_and_gradients_are_as_accurate_as_reference(problem, exact_reference, d, t):
    """With bfloat16 operands (the training precision) the loss matches the bfloat16 reference to
    1e-4, and the gradients are about as close to the exact ones as the bfloat16 reference's are
    (the two round at different points: blockwise attention rounds unnormalized softmax
    weights, the reference normalized ones). Measured on this tiny model: both 0.3-1.1e-2."""
    h, weights, batch, ref_loss, ref_grads = problem
    _, exact_grads = exact_reference
    loss, grads = sharded_loss_and_grads(h, make_mesh(d, t), weights, batch)
    assert abs(float(loss) - ref_loss) <= 1e-4 * abs(ref_loss), (float(loss), ref_loss)
    ours = relative_errors(weights_to_dicts(grads, h.model.layers), exact_grads)
    reference_mean = np.mean([err for _, err in relative_errors(ref_grads, exact_grads)])
    for path, err in ours:
        assert err < 1.5e-2, f"gradient {path}: relative L2 error {err:.2e} from exact on mesh {d}x{t}"
    assert np.mean([err for _, err in ours]) < 1.2 * reference_mean, (ours, reference_mean)


def test_reference_loss_is_near_log_vocab_at_init(problem):
    """Guards the reference itself: a broken reference could agree with a broken model."""
    h, *_, ref_loss, _ = problem
    assert abs(ref_loss - np.log(h.model.vocab)) < 2.0


def test_training_step_reports_reference_loss_and_grad_norm(problem):
    h, weights, batch, ref_loss, ref_grads = problem
    ref_norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(ref_grads)))
    mesh = make_mesh(4, 2)
    with jax.set_mesh(mesh):
        shardings = make_shardings(train.State, mesh)
        zeros = jax.tree.map(np.zeros_like, weights)
        state = jax.device_put(train.State(weights, zeros, zeros), shardings)
        new_state, metrics = train.training_step(state, jnp.uint32(0), *put_batch(mesh, batch), h)
    assert abs(float(metrics.loss) - ref_loss) <= 1e-4 * ref_loss
    assert abs(float(metrics.grad_norm) - ref_norm) <= 1e-2 * ref_norm
    assert new_state.weights.embed.sharding == shardings.weights.embed
    assert not np.array_equal(np.asarray(new_state.weights.embed), weights.embed)
