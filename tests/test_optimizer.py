"""AdamW, clipping and the schedule against numbers worked out by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import config
import train
from model_fixtures import tiny_config


@pytest.fixture(scope="module")
def h() -> config.TrainingConfig:
    # peak 1e-2, 4 warmup steps, 20 steps, cosine to 10%, b1 0.9, b2 0.95, eps 1e-8, clip 1.0
    return tiny_config("training.weight_decay=0.1").training


@pytest.mark.parametrize("step,expected", [(0, 2.5e-3), (1, 5e-3), (3, 1e-2), (4, 1e-2), (9, 7.75e-3), (19, 1e-3)])
def test_schedule(h, step, expected):
    # warmup: (step + 1) / 4 of the peak; then 0.1 + 0.9 * (1 + cos(pi * (step - 4) / 15)) / 2
    assert float(train.learning_rate(h, jnp.uint32(step))) == pytest.approx(expected, rel=1e-5)


def test_first_adamw_step_moves_each_weight_by_lr_times_sign_plus_decay(h):
    # At step 0 the bias-corrected moments are g and g^2, so the update is g / |g| = sign(g).
    weights = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([[0.5]])}
    grads = {"a": jnp.array([0.3, -0.4]), "b": jnp.array([[0.0]])}  # global norm 0.5: no clipping
    zeros = jax.tree.map(jnp.zeros_like, weights)
    w, mu, nu, lr = train.optimizer_step(h, jnp.uint32(0), weights, grads, zeros, zeros, jnp.float32(0.5))
    assert float(lr) == pytest.approx(2.5e-3)
    np.testing.assert_allclose(w["a"], [1.0 - 2.5e-3 * (1 + 0.1 * 1.0), -2.0 - 2.5e-3 * (-1 + 0.1 * -2.0)], rtol=1e-6)
    np.testing.assert_allclose(w["b"], [[0.5 - 2.5e-3 * 0.1 * 0.5]], rtol=1e-6)  # zero gradient: decay only
    np.testing.assert_allclose(mu["a"], [0.03, -0.04], rtol=1e-6)
    np.testing.assert_allclose(nu["a"], [0.05 * 0.09, 0.05 * 0.16], rtol=1e-6)


def test_later_adamw_step_with_clipping(h):
    # Step 2 (t = 3 for bias correction), global norm 5 clipped to 1: g is scaled by 0.2.
    w0, g, mu0, nu0 = 0.7, 2.0, 0.1, 0.02
    tree = lambda v: {"x": jnp.array([v])}  # noqa: E731
    w, mu, nu, lr = train.optimizer_step(h, jnp.uint32(2), tree(w0), tree(g), tree(mu0), tree(nu0), jnp.float32(5.0))
    gc = g * 0.2
    mu1 = 0.9 * mu0 + 0.1 * gc
    nu1 = 0.95 * nu0 + 0.05 * gc * gc
    mu_hat, nu_hat = mu1 / (1 - 0.9**3), nu1 / (1 - 0.95**3)
    lr2 = 1e-2 * 3 / 4
    expected = w0 - lr2 * (mu_hat / (math.sqrt(nu_hat) + 1e-8) + 0.1 * w0)
    assert float(lr) == pytest.approx(lr2)
    assert float(mu["x"][0]) == pytest.approx(mu1, rel=1e-6)
    assert float(nu["x"][0]) == pytest.approx(nu1, rel=1e-6)
    assert float(w["x"][0]) == pytest.approx(expected, rel=1e-6)


def test_clip_scale(h):
    assert float(train.clip_scale(h, jnp.float32(0.5))) == 1.0
    assert float(train.clip_scale(h, jnp.float32(4.0))) == pytest.approx(0.25)
    assert float(train.clip_scale(h, jnp.float32(0.0))) == 1.0
