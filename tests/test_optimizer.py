"""The optimizers against plain float64 NumPy statements written from the papers: Newton-Schulz and
whole runs of Muon and AdamW (on every mesh shape, so through Muon's all-to-all), the schedule and
clipping by the properties that define them."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import train
from fixtures import make_mesh, metrics_on_meshes, tiny_config
from seqax import config, muon_sharding
from seqax.shardlib.shardops import global_norm
from seqax.shardlib.shardtypes import f32, make_shardings, typed_shard_map, u32

# bfloat16 keeps 8 significant bits: rounding to it moves a value by up to U relative.
U = 2.0**-8


def training(**changes) -> config.TrainingConfig:
    values = dict(steps=20, tokens=config.TokensConfig(batch=8, len=16), learning_rate=1e-2, warmup_steps=4,
                  final_learning_rate_fraction=0.1, seed=0, adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8,
                  weight_decay=0.1, grad_clip=1.0, muon_learning_rate=0.02, muon_momentum=0.95, muon_weight_decay=0.1)
    return config.TrainingConfig(**{**values, **changes})


def fractions(h: config.TrainingConfig) -> np.ndarray:
    return np.array([float(train.schedule(h, jnp.uint32(s))) for s in range(h.steps)])


# ---------------------------------------------------------------------------------------------
# The schedule: linear warmup to the peak, then a half cosine down to the final fraction.


@pytest.mark.parametrize("warmup,steps", [(4, 20), (10, 31), (0, 12), (1, 9)])
def test_schedule_warms_up_linearly_then_follows_a_half_cosine(warmup, steps):
    h = training(warmup_steps=warmup, steps=steps)
    lr, final = fractions(h), h.final_learning_rate_fraction  # of the peak
    assert lr.max() == pytest.approx(1.0, rel=1e-6) and np.all(lr > 0)
    if warmup:  # a straight line through 0 at step -1 that reaches the peak at step warmup - 1
        np.testing.assert_allclose(lr[:warmup], np.arange(1, warmup + 1) / warmup, rtol=1e-6)
    decay = lr[max(warmup - 1, 0) :]  # from the peak to the last step
    assert decay[0] == pytest.approx(1.0, rel=1e-6) and lr[-1] == pytest.approx(final, rel=1e-5)
    assert np.all(np.diff(decay) <= 1e-9), decay  # never rises after the peak
    # A cosine's half period is symmetric about its middle: steps equally far from the middle of
    # the decay lie equally far above and below the mean of the peak and the final rate.
    decay = lr[warmup:]
    np.testing.assert_allclose(decay + decay[::-1], np.full(len(decay), 1 + final), rtol=1e-5)
    if len(decay) >= 4:  # and it is not a straight line: a cosine falls slowest at its ends
        slopes = -np.diff(decay)
        assert slopes[0] < slopes[len(slopes) // 2] and slopes[-1] < slopes[len(slopes) // 2]


# ---------------------------------------------------------------------------------------------
# Newton-Schulz: Jordan et al. 2024's quintic iteration, in float64, with nothing rounded.


def numpy_newton_schulz(G: np.ndarray, steps: int = 5) -> np.ndarray:
    """X <- aX + (bA + cA^2)X, A = X X^T, from X = G / ||G||_F, on G or (if tall) on G^T."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = G.shape[0] > G.shape[1]
    X = (G.T if tall else G).astype(np.float64)
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def relative(x, reference) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - reference) / np.linalg.norm(reference))


@pytest.mark.parametrize("shape", [(64, 128), (256, 1024), (128, 64)])
@pytest.mark.parametrize("rank", ["full", "low"])
def test_newton_schulz_equals_the_float64_iteration_to_bf16_rounding(shape, rank):
    """train.newton_schulz (operands in bf16, sums in float32) against the float64 iteration on the
    same bf16 input. Each of its 15 matmuls rounds both operands to bf16 (up to U = 2^-8 relative,
    about U / sqrt(3) on average), and the last iterations, whose derivative on the band where the
    singular values end ([0.68, 1.13]) is about 1, pass those errors on while the early ones are
    damped or amplified (by up to a = 3.4 per step for small singular values). A full-rank Gaussian
    matrix is the worst case, every singular value small at first: measured 2.3-2.8% (6-7 U); a
    gradient-like low-rank one 0.06-0.2%. The bound is 16 U (6.3%); a wrong coefficient, a
    missing step or the wrong Gram matrix misses it by far (checked below on the float64 iteration)."""
    rng = np.random.default_rng(sum(shape))
    G = rng.standard_normal(shape)
    if rank == "low":
        G = rng.standard_normal((shape[0], 4)) @ rng.standard_normal((4, shape[1])) + 0.05 * G
    G = G.astype(ml_dtypes.bfloat16).astype(np.float64)
    tall = shape[0] > shape[1]
    ours = np.asarray(jax.jit(functools.partial(train.newton_schulz, dtype=jnp.bfloat16))(
        jnp.asarray(G.T if tall else G, jnp.bfloat16)))
    ours = ours.T if tall else ours
    want = numpy_newton_schulz(G)
    assert relative(ours, want) <= 16 * U, relative(ours, want)
    singular_values = np.linalg.svd(ours, compute_uv=False)
    if rank == "full":  # the iteration's band: every direction of G kept, none blown up
        assert 0.6 < singular_values.min() and singular_values.max() < 1.25, singular_values
        assert relative(numpy_newton_schulz(G, steps=4), want) > 16 * U  # one step fewer is caught


def test_a_wrong_iteration_misses_the_bound():
    """The bound has teeth: the iteration with a coefficient off by 10%, or started from G without
    dividing by its norm, lands far outside 16 U of the right one."""
    G = np.random.default_rng(0).standard_normal((64, 128))
    want = numpy_newton_schulz(G)

    def iterate(X, a=3.4445, b=-4.7750, c=2.0315):
        for _ in range(5):
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        return X

    assert relative(iterate(G / np.linalg.norm(G), a=3.1), want) > 16 * U
    assert relative(iterate(G / np.linalg.norm(G), c=1.83), want) > 16 * U
    with np.errstate(over="ignore", invalid="ignore"):  # G's singular values above 1 blow up
        unnormalized = relative(iterate(G), want)
    assert not np.isfinite(unnormalized) or unnormalized > 16 * U


# ---------------------------------------------------------------------------------------------
# Muon's groups: weights of one shape with d_model first spread and orthogonalize together, as long as
# that gives no device more matrices than one weight alone would.


@pytest.mark.parametrize("layers,devices,largest", [(32, 256, 3), (3, 8, 2), (16, 8, 1), (16, 1, 1), (20, 8, 1)])
def test_same_shaped_weights_go_together_while_no_device_holds_more(layers, devices, largest):
    groups = muon_sharding.matrix_groups(train.MUON, layers, devices)
    assert sorted(n for g in groups for n in g) == sorted(train.MUON)  # each weight once
    assert max(len(g) for g in groups) == largest
    for g in groups:
        assert len({train.MUON[n].spread for n in g}) == 1  # one spread, so one shape with M first
        assert -(-layers * len(g) // devices) <= -(-layers // devices)  # no device holds more matrices
    if largest == 3:
        assert ["w_q", "w_o"] in groups and ["w_k", "w_v"] in groups and ["w_gate", "w_up", "w_down"] in groups


def test_a_weight_with_d_model_last_goes_as_its_transpose_and_keeps_its_scale():
    """w_o [Q K D, M] and expert_down [E, H, M] are moved M first (and back), to w_q's and expert_gate's
    shapes; their fans are the stored weight's (w_o maps Q K D inputs to M outputs)."""
    w = jax.eval_shape(lambda: train.init_weights(tiny_config("+model.experts=4", "+model.experts_per_token=2",
                                                              "+model.expert_d_ff=24", "+model.expert_block=8").model,
                                                  jax.random.key(0))).layers
    for moved, like in (("w_o", "w_q"), ("w_down", "w_gate"), ("expert_down", "expert_gate")):
        x = np.arange(np.prod(getattr(w, moved).shape), dtype=np.float32).reshape(getattr(w, moved).shape)
        first = muon_sharding.rows_first(jnp.asarray(x), train.MUON[moved])
        assert first.shape == getattr(w, like).shape, moved
        np.testing.assert_array_equal(muon_sharding.rows_back(first, train.MUON[moved]), x)
        count, rows, cols = muon_sharding.matrices_of(getattr(w, moved).shape[1:], train.MUON[moved])
        assert (count, rows, cols) == muon_sharding.matrices_of(getattr(w, like).shape[1:], train.MUON[like])
        assert muon_sharding.fans(first, train.MUON[moved]) == (cols, rows)  # fan_in: the heads (or F, H)
        assert muon_sharding.fans(first, train.MUON[like]) == (rows, cols)  # fan_in: d_model
    assert train.MUON["w_o"].spread == train.MUON["w_q"].spread and train.MUON["w_o"].m_last


# ---------------------------------------------------------------------------------------------
# Whole runs: Muon (Jordan et al. 2024, as modded-nanogpt writes it) on the layers' matrices and
# AdamW (Loshchilov & Hutter 2019, Algorithm 2, with Kingma & Ba 2015's bias correction, in
# torch.optim.AdamW's convention) on the rest, after clipping the gradient to a global L2 norm.

def muon_rows(weights: dict, d_model: int) -> dict:
    """{name: rows} of the weights Muon updates (which ones is the code's choice: those train.MUON names),
    rows stated here on its own: how many dimensions after `layers` are the matrix's rows (its fan-in:
    the weights are stored [in, out], x @ w), d_model's one where d_model comes first, else all before it."""
    return {k: 1 if x.shape[1] == d_model else x.ndim - 2 for k, x in weights.items()
            if k.removeprefix("layers.") in train.MUON and x.size}


@functools.cache
def run_config(h: config.TrainingConfig) -> config.Config:
    """The tiny config with training section `h`."""
    return dataclasses.replace(tiny_config(), training=h)


def numpy_optimizers(h: config.TrainingConfig, weights: dict, gradients: list[dict], lr: np.ndarray,
                     rows: dict) -> list[dict]:
    """The weights after each step, in float64: Muon on the weights `rows` names (muon_rows), AdamW on the
    others."""
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
            if k not in rows:  # AdamW
                m[k] = h.adam_b1 * m[k] + (1 - h.adam_b1) * g[k]
                v[k] = h.adam_b2 * v[k] + (1 - h.adam_b2) * g[k] ** 2
                m_hat, v_hat = m[k] / (1 - h.adam_b1**t), v[k] / (1 - h.adam_b2**t)
                adam = m_hat / (np.sqrt(v_hat) + h.adam_eps)
                w[k] = w[k] - lr[t - 1] * h.learning_rate * (adam + h.weight_decay * w[k])
                continue
            m[k] = h.muon_momentum * m[k] + (1 - h.muon_momentum) * g[k]  # Muon: momentum, then Nesterov's look-ahead
            nesterov = (1 - h.muon_momentum) * g[k] + h.muon_momentum * m[k]
            fan_in, fan_out = int(np.prod(w[k].shape[1 : 1 + rows[k]])), int(np.prod(w[k].shape[1 + rows[k] :]))
            update = np.stack([numpy_newton_schulz(x.reshape(fan_in, fan_out)).reshape(x.shape) for x in nesterov])
            scale = np.sqrt(max(1.0, fan_out / fan_in))
            w[k] = w[k] - lr[t - 1] * h.muon_learning_rate * (scale * update + h.muon_weight_decay * w[k])
        history.append({k: x.copy() for k, x in w.items()})
    return history


def named(model: train.Model) -> dict:
    """{'embed': ..., 'layers.w_q': ...}: the leaves of a Model by key path."""
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(model)[0]}


def run_optimizer(h: config.TrainingConfig, mesh, weights: train.Model, gradients: list[train.Model]) -> list[dict]:
    """train.optimizer_step inside shard_map on `mesh`, from a fresh state: the weights after each step."""
    with jax.set_mesh(mesh):
        @jax.jit
        @typed_shard_map
        def step(state: train.State, step: u32[b""], grads: train.Model) -> train.State:
            no_load = jnp.zeros_like(state.weights.layers.expert_bias)  # dense: no experts
            return train.optimizer_step(run_config(h), step, state, grads, global_norm(grads, train.Model), no_load)[0]

        shardings = make_shardings(train.Model, mesh)
        state = jax.jit(train.fresh_state, out_shardings=make_shardings(train.State, mesh))(weights)
        history = []
        for i, grads in enumerate(gradients):
            state = step(state, jnp.uint32(i), jax.device_put(grads, shardings))
            history.append(named(state.weights))
    return history


@pytest.fixture(scope="module")
def problem():
    """The tiny model's initial weights (norms moved off 1) and 6 steps of random gradients: global
    norms far above and below the clip, and one weight whose gradient is always zero."""
    cfg = tiny_config()
    h = training(steps=6, warmup_steps=2, grad_clip=1.0)
    rng = np.random.default_rng(0)
    weights = train.init_weights(cfg.model, jax.random.key(0))
    weights = jax.tree.map(lambda x: np.asarray(x) + (0.1 * rng.standard_normal(x.shape) if x.ndim < 3 else 0),
                           weights)
    gradients = []
    for step in range(h.steps):
        scale = 0.05 if step % 2 else 3.0
        grads = jax.tree.map(lambda x, scale=scale: (scale / 30 * rng.standard_normal(x.shape)).astype(np.float32),
                             weights)
        gradients.append(train.Model(grads.embed, grads.layers, 0 * grads.final_norm, grads.unembed))
    norms = [np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(g)))
             for g in gradients]
    assert min(norms) < h.grad_clip < max(norms), norms
    rows = muon_rows(named(weights), cfg.model.d_model)
    want = numpy_optimizers(h, named(weights), [named(g) for g in gradients], fractions(h), rows)
    return h, weights, gradients, want, rows


@pytest.mark.parametrize("d,t,c", [(1, 1, 1), pytest.param(4, 2, 1, marks=pytest.mark.slow),
                                   pytest.param(2, 2, 2, marks=pytest.mark.slow),
                                   pytest.param(1, 8, 1, marks=pytest.mark.slow)])
def test_a_run_of_muon_and_adamw_matches_the_numpy_statement(problem, d, t, c):
    """Every step of a 6-step run (warmup, decay, clipped and unclipped gradients, a weight whose
    gradient is zero) lands where the NumPy statement does. AdamW's weights to float32 rounding.
    Muon's change of each weight to 16 U, as Newton-Schulz alone (above): its input is the
    momentum rounded to bf16 once more (U), which the iteration's error dwarfs; on 8 devices its
    layers travel through the all-to-all and back, which must not move a value."""
    h, weights, gradients, want, rows = problem
    ours = run_optimizer(h, make_mesh(d, t, c), weights, gradients)
    start = named(weights)
    for step, (got, expected) in enumerate(zip(ours, want)):
        for name, x in got.items():
            if name in rows:
                change = relative(x - start[name], expected[name] - start[name])
                assert change <= 16 * U, (name, step, change)
            else:
                np.testing.assert_allclose(x, expected[name], rtol=2e-6, atol=2e-7, err_msg=f"{name} after step {step}")
    # The weight without gradient only decays: w * prod(1 - lr * decay).
    decay = np.prod(1 - fractions(h) * h.learning_rate * h.weight_decay)
    np.testing.assert_allclose(ours[-1]["final_norm"], decay * start["final_norm"], rtol=1e-5)


def test_the_numpy_statement_notices_a_wrong_muon():
    """The check has teeth: without Nesterov's look-ahead, or with the rows of a Muon weight whose rows
    span several dimensions (w_o's [Q, K, D | M], unless an edit gave w_o to AdamW) taken as one, the
    NumPy run's Muon weights move outside 16 U of the right one."""
    cfg = tiny_config()
    h = training(steps=3, warmup_steps=1)
    rng = np.random.default_rng(1)
    w = named(train.init_weights(cfg.model, jax.random.key(0)))
    grads = [{k: rng.standard_normal(x.shape) for k, x in w.items()} for _ in range(h.steps)]
    rows = muon_rows(w, cfg.model.d_model)
    right = numpy_optimizers(h, w, grads, fractions(h), rows)[-1]
    no_nesterov = numpy_optimizers(training(steps=3, warmup_steps=1, muon_momentum=0.0), w, grads, fractions(h),
                                   rows)[-1]
    assert relative(no_nesterov["layers.w_q"] - w["layers.w_q"], right["layers.w_q"] - w["layers.w_q"]) > 16 * U
    for name in [k for k, r in rows.items() if r > 1]:
        wrong_rows = numpy_optimizers(h, w, grads, fractions(h), {**rows, name: 1})[-1]
        assert relative(wrong_rows[name] - w[name], right[name] - w[name]) > 16 * U, name


# ---------------------------------------------------------------------------------------------
# Clipping: one scale from the global norm, for every weight and both optimizers.


@functools.cache
def first_step(h: config.TrainingConfig):
    """optimizer_step's first step on a 1x1 mesh, compiled once per config."""
    @jax.jit
    @typed_shard_map
    def step(state: train.State, grads: train.Model, grad_norm: f32[b""]) -> train.State:
        return train.optimizer_step(run_config(h), jnp.uint32(0), state, grads, grad_norm,
                                    jnp.zeros_like(state.weights.layers.expert_bias))[0]

    return step


def first_step_gradient(h, grads: train.Model, grad_norm: float) -> dict:
    """The gradient the first step used, read back from the optimizers' first moments, which start
    at zero: AdamW's mu = (1 - b1) g, Muon's momentum = (1 - momentum) g."""
    with jax.set_mesh(make_mesh(1, 1)):
        state = first_step(h)(train.fresh_state(jax.tree.map(jnp.zeros_like, grads)), grads, jnp.float32(grad_norm))
    adam = {k: x / (1 - h.adam_b1) for k, x in named(state.adam_mu).items()}
    muon = {k: x / (1 - h.muon_momentum) for k, x in named(state.muon_momentum).items()}
    return {k: np.asarray(x, np.float64) for k, x in {**adam, **muon}.items()}


@pytest.mark.parametrize("norm_factor", [0.0, 0.3, 0.999, 1.5, 40.0])
def test_clipping_scales_the_gradient_to_at_most_the_clip_norm_keeping_its_direction(norm_factor):
    h = training(grad_clip=2.0)
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(lambda: train.init_weights(tiny_config().model, jax.random.key(0)))
    direction = jax.tree.map(lambda s: rng.standard_normal(s.shape), shapes)
    norm = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(direction)))
    grads = jax.tree.map(lambda x: jnp.asarray(x / norm * norm_factor * h.grad_clip, jnp.float32), direction)
    used = first_step_gradient(h, grads, np.sqrt(sum(np.sum(np.square(x, dtype=np.float64))
                                                     for x in named(grads).values())))
    given = {k: x for k, x in named(grads).items() if k in used}  # the experts' bias follows their load, no gradient
    used_norm = np.sqrt(sum(np.sum(x * x) for x in used.values()))
    assert used_norm == pytest.approx(min(norm_factor, 1.0) * h.grad_clip, rel=1e-5, abs=1e-12)
    for k, x in given.items():  # every weight by the same factor: the direction of the whole gradient is kept
        np.testing.assert_allclose(used[k], x * min(1.0, 1.0 / max(norm_factor, 1e-30)), rtol=1e-5, atol=1e-12)


@pytest.mark.slow
def test_clipping_uses_the_norm_it_is_given():
    """The step clips by the global norm passed in (summed over every device's shards), not by
    the norm of the leaves it sees: a gradient of norm 1 reported as 4 is used at a quarter."""
    h = training(grad_clip=1.0)
    shapes = jax.eval_shape(lambda: train.init_weights(tiny_config().model, jax.random.key(0)))
    grads = jax.tree.map(lambda s: jnp.full(s.shape, 1 / np.sqrt(sum(x.size for x in jax.tree.leaves(shapes))),
                                            jnp.float32), shapes)
    used = first_step_gradient(h, grads, 4.0)
    assert set(named(grads)) - set(used) == {"layers.expert_bias"}  # it follows the experts' load, not a gradient
    for k, x in ((k, x) for k, x in named(grads).items() if k in used):
        np.testing.assert_allclose(used[k], x / 4, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The whole step on every mesh shape: Muon's bf16 orthogonalization must not make the losses
# depend on the mesh beyond float32 rounding.


@pytest.mark.slow
def test_training_steps_agree_on_every_mesh(default_dataset):
    """The tiny model on rows of 256 packed documents of the synthetic dataset, steps 0-2 on meshes
    1x1, 8x1, 4x2 and 1x8: the step-0 loss (before any update) within 1e-5 relative of the 1x1
    run's, steps 1 and 2 (after Muon's and AdamW's updates) within 1e-4. Measured: up to 1.5e-6 at
    step 0 and 6.6e-5 after, seeds 0-3 (the gradients are summed from parts each device rounded to
    bf16, so they differ between meshes by ~1e-3, and bf16 Newton-Schulz spreads that over the update;
    on one device, the batch's rows reversed moved steps 1-2 by up to 2.6e-5: bench.mesh_agreement
    --rows-reversed). The same bounds with context parallelism (d=2 t=2 c=2) are test_context_parallel's."""
    cfg = tiny_config("training.tokens.len=256", "model.attention_block=32", f"dataset.path={default_dataset}")
    runs = metrics_on_meshes(cfg, [(1, 1, 1), (8, 1, 1), (4, 2, 1), (1, 8, 1)], steps=3)
    losses = {mesh: [metrics["loss"] for metrics in run] for mesh, run in runs.items()}
    one_device = losses[1, 1, 1]
    assert one_device[2] < one_device[0] - 0.05  # it learns: the updates are not negligible
    for mesh_shape, run in losses.items():
        assert abs(run[0] / one_device[0] - 1) <= 1e-5, (mesh_shape, run, one_device)
        assert all(abs(a / b - 1) <= 1e-4 for a, b in zip(run[1:], one_device[1:])), (mesh_shape, run, one_device)
