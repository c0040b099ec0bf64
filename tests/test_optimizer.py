"""The optimizer against a plain float64 NumPy AdamW written from the papers, over a whole run,
and the learning-rate schedule and clipping by the properties that define them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import config
import train


def training(**changes) -> config.TrainingConfig:
    values = dict(steps=20, tokens=config.TokensConfig(batch=8, len=16), learning_rate=1e-2, warmup_steps=4,
                  final_learning_rate_fraction=0.1, seed=0,
                  adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    return config.TrainingConfig(**{**values, **changes})


def rates(h: config.TrainingConfig) -> np.ndarray:
    return np.array([float(train.learning_rate(h, jnp.uint32(s))) for s in range(h.steps)])


# ---------------------------------------------------------------------------------------------
# The schedule: linear warmup to the peak, then a half cosine down to the final fraction.


@pytest.mark.parametrize("warmup,steps", [(4, 20), (10, 31), (0, 12), (1, 9)])
def test_schedule_warms_up_linearly_then_follows_a_half_cosine(warmup, steps):
    h = training(warmup_steps=warmup, steps=steps)
    lr, peak, final = rates(h), h.learning_rate, h.learning_rate * h.final_learning_rate_fraction
    assert lr.max() == pytest.approx(peak, rel=1e-6) and np.all(lr > 0)
    if warmup:  # a straight line through 0 at step -1 that reaches the peak at step warmup - 1
        np.testing.assert_allclose(lr[:warmup], peak * np.arange(1, warmup + 1) / warmup, rtol=1e-6)
    decay = lr[max(warmup - 1, 0) :]  # from the peak to the last step
    assert decay[0] == pytest.approx(peak, rel=1e-6) and lr[-1] == pytest.approx(final, rel=1e-5)
    assert np.all(np.diff(decay) <= 1e-9 * peak), decay  # never rises after the peak
    # A cosine's half period is symmetric about its middle: steps equally far from the middle of
    # the decay lie equally far above and below the mean of the peak and the final rate.
    decay = lr[warmup:]
    np.testing.assert_allclose(decay + decay[::-1], np.full(len(decay), peak + final), rtol=1e-5)
    if len(decay) >= 4:  # and it is not a straight line: a cosine falls slowest at its ends
        slopes = -np.diff(decay)
        assert slopes[0] < slopes[len(slopes) // 2] and slopes[-1] < slopes[len(slopes) // 2]


# ---------------------------------------------------------------------------------------------
# AdamW: a NumPy statement of Loshchilov & Hutter 2019, Algorithm 2, with the bias correction of
# Kingma & Ba 2015, Algorithm 1, in the convention of torch.optim.AdamW (the decoupled decay is
# scaled by the learning rate), after clipping the gradient to a global L2 norm.


def numpy_adamw(h: config.TrainingConfig, weights: dict, gradients: list[dict], lr: np.ndarray) -> list[dict]:
    """The weights after each step of AdamW on the given gradients, in float64."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    history = []
    for t, grads in enumerate(gradients, start=1):
        g = {k: np.asarray(x, np.float64) for k, x in grads.items()}
        norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
        if norm > h.grad_clip:
            g = {k: x * h.grad_clip / norm for k, x in g.items()}
        for k in w:
            m[k] = h.adam_b1 * m[k] + (1 - h.adam_b1) * g[k]
            v[k] = h.adam_b2 * v[k] + (1 - h.adam_b2) * g[k] ** 2
            m_hat, v_hat = m[k] / (1 - h.adam_b1**t), v[k] / (1 - h.adam_b2**t)
            w[k] = w[k] - lr[t - 1] * (m_hat / (np.sqrt(v_hat) + h.adam_eps) + h.weight_decay * w[k])
        history.append({k: x.copy() for k, x in w.items()})
    return history


def global_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))


def test_a_whole_run_of_adamw_matches_the_numpy_statement():
    """Every step of a 20-step run (warmup, decay, clipped and unclipped gradients, a weight whose
    gradient is zero) lands where the NumPy AdamW does, to float32 rounding."""
    h = training()
    rng = np.random.default_rng(0)
    weights = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32),
               "still": np.ones(2, np.float32)}
    gradients = []
    for step in range(h.steps):
        scale = 3.0 if step % 3 == 0 else 0.05  # global norms well above and well below the clip
        gradients.append({k: (scale * rng.standard_normal(x.shape) * (k != "still")).astype(np.float32)
                          for k, x in weights.items()})
    assert (sum(global_norm(g) > h.grad_clip for g in gradients) >= 5
            and sum(global_norm(g) < h.grad_clip for g in gradients) >= 5)
    expected = numpy_adamw(h, weights, gradients, rates(h))

    step_fn = jax.jit(lambda step, w, g, mu, nu: train.optimizer_step(
        h, step, w, g, mu, nu, jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))))
    w = jax.tree.map(jnp.asarray, weights)
    mu = nu = jax.tree.map(jnp.zeros_like, w)
    for step, (grads, want) in enumerate(zip(gradients, expected)):
        w, mu, nu, lr = step_fn(jnp.uint32(step), w, grads, mu, nu)
        for k in weights:
            np.testing.assert_allclose(np.asarray(w[k]), want[k], rtol=2e-6, atol=2e-7,
                                       err_msg=f"{k} after step {step}")
    # The weight without gradient only decays: w * prod(1 - lr * decay).
    np.testing.assert_allclose(np.asarray(w["still"]), np.prod(1 - rates(h) * h.weight_decay) * np.ones(2), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Clipping: one scale from the global norm, for every weight.


def first_step_gradient(h, grads: dict, grad_norm: float) -> dict:
    """The gradient that the first AdamW step used, read back from its first moment (which
    starts at zero, so that mu = (1 - b1) * gradient)."""
    zeros = jax.tree.map(jnp.zeros_like, grads)
    _, mu, _, _ = train.optimizer_step(h, jnp.uint32(0), zeros, grads, zeros, zeros, jnp.float32(grad_norm))
    return jax.tree.map(lambda x: np.asarray(x, np.float64) / (1 - h.adam_b1), mu)


@pytest.mark.parametrize("norm_factor", [0.0, 0.3, 0.999, 1.5, 40.0])
def test_clipping_scales_the_gradient_to_at_most_the_clip_norm_keeping_its_direction(norm_factor):
    h = training(grad_clip=2.0)
    rng = np.random.default_rng(1)
    # Each leaf alone is under the clip norm; together they may be far above it.
    direction = {"a": rng.standard_normal(6), "b": rng.standard_normal((2, 3))}
    norm = global_norm(direction)
    grads = {k: jnp.asarray(x / norm * norm_factor * h.grad_clip, jnp.float32) for k, x in direction.items()}
    used = first_step_gradient(h, grads, global_norm(grads))
    assert global_norm(used) == pytest.approx(min(norm_factor, 1.0) * h.grad_clip, rel=1e-5, abs=1e-12)
    for k in grads:  # every leaf by the same factor: the direction of the whole gradient is kept
        np.testing.assert_allclose(used[k], np.asarray(grads[k]) * min(1.0, 1.0 / max(norm_factor, 1e-30)),
                                   rtol=1e-5, atol=1e-12)
    assert all(np.all(np.isfinite(x)) for x in used.values())


def test_clipping_uses_the_norm_it_is_given():
    """The step clips by the global norm passed in (summed over every device's shards), not by
    the norm of the leaves it sees: a gradient of norm 1 reported as 4 is used at a quarter."""
    h = training(grad_clip=1.0)
    grads = {"a": jnp.asarray([0.6, 0.8], jnp.float32)}
    used = first_step_gradient(h, grads, 4.0)
    np.testing.assert_allclose(used["a"], [0.15, 0.2], rtol=1e-6)
