"""The sharded model against tests/reference.py on every mesh shape of 8 devices."""

import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import reference
import train
from fixtures import (
    abstract_state,
    float32_config,
    make_mesh,
    perturbed_weights,
    put_batch,
    random_batch,
    reference_config,
    tiny_config,
)
from reference import loss as reference_loss
from reference import weights_to_dicts
from seqax.analysis.startup_report import compile_step
from seqax.shardlib.shardtypes import bool_, f32, make_shardings, typed_shard_map, u32

MESHES = [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8)]
# The tiny model has 2 layers of 8 kv heads, so that every mesh of 8 devices splits its heads.
# SMALL has 1 layer of 2 kv heads: its reference (a loop over heads) compiles in seconds, for
# the fast tier; it still splits the batch over d and the heads, d_ff and vocabulary over t=2.
SMALL = ("model.n_kv=2", "model.layers=1")


def make_problem(*overrides: str):
    """(config, weights, batch) of the tiny model changed by `overrides`."""
    cfg = tiny_config(*overrides)
    return (cfg, jax.device_get(perturbed_weights(cfg)),
            random_batch(0, cfg.training.tokens.batch, cfg.training.tokens.len, cfg.model.vocab))


def reference_value_and_grad(cfg, weights, batch, matmul_dtype) -> tuple[float, dict]:
    """tests/reference.py's loss and gradients with `matmul_dtype` matmul operands (float32: the exact math)."""
    reference_cfg = reference_config(cfg.model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "bf16", matmul_dtype)
        loss, grads = jax.jit(jax.value_and_grad(lambda w: reference_loss(w, reference_cfg, *batch)))(
            weights_to_dicts(weights, cfg.model.layers))
    return float(loss), grads


@pytest.fixture(scope="module")
def problem():
    cfg, weights, batch = make_problem()
    return cfg, weights, batch, *reference_value_and_grad(cfg, weights, batch, jnp.bfloat16)


@pytest.fixture(scope="module")
def exact_reference(problem):
    return reference_value_and_grad(*problem[:3], jnp.float32)


@pytest.fixture(scope="module")
def small_problem():
    cfg, weights, batch = make_problem(*SMALL)
    return cfg, weights, batch, *reference_value_and_grad(cfg, weights, batch, jnp.float32)


def relative_errors(grads: dict, ref_grads: dict) -> list[tuple[str, float]]:
    """(path, relative L2 error) of every gradient in `grads` against `ref_grads` (reference dicts)."""
    flat_ref, flat = jax.tree_util.tree_flatten_with_path(ref_grads)[0], jax.tree.leaves(grads)
    assert len(flat_ref) == len(flat)
    return [
        (jax.tree_util.keystr(path), np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r, np.float64))
         / np.linalg.norm(np.asarray(r, np.float64)))
        for (path, r), g in zip(flat_ref, flat) if np.size(r)  # (a dense model's experts are empty)
    ]


def sharded_loss_and_grads(cfg, mesh, weights, batch):
    @typed_shard_map
    def on_device(w: train.Model, targets: u32[b"B/d L/c"], starts: bool_[b"B/d L/c"],
                  mask: bool_[b"B/d L/c"]) -> tuple[f32[b""], train.Model]:
        (_, (loss, _)), grads = jax.value_and_grad(partial(train.model_loss, cfg.model, 0.0), has_aux=True)(
            w, targets, starts, mask)
        return lax.psum(loss, ("d", "c")), grads

    with jax.set_mesh(mesh):
        w = jax.device_put(weights, make_shardings(train.Model, mesh))
        return jax.device_get(jax.jit(on_device)(w, *put_batch(mesh, batch)))


def assert_float32_equals_reference(cfg, weights, batch, exact_loss, exact_grads, d, t):
    """With float32 matmul operands in both, the sharded model and the reference compute the
    same numbers up to the order of float32 sums: every sharding, mask, RoPE and attention
    block is checked to 1e-4 (bfloat16 rounding would hide errors below ~1e-2)."""
    loss, grads = sharded_loss_and_grads(float32_config(cfg), make_mesh(d, t), weights, batch)
    assert abs(float(loss) - exact_loss) <= 1e-6 * abs(exact_loss), (float(loss), exact_loss)
    for path, err in relative_errors(weights_to_dicts(grads, cfg.model.layers), exact_grads):
        assert err < 1e-4, f"gradient {path}: relative L2 error {err:.2e} on mesh {d}x{t}"


# The sharded case in the fast tier; the slow tier also checks every mesh of 8 devices.
@pytest.mark.parametrize("d,t", [pytest.param(1, 1, marks=pytest.mark.slow), (4, 2)])
def test_float32_loss_and_gradients_of_a_small_model_equal_reference(small_problem, d, t):
    assert_float32_equals_reference(*small_problem, d, t)


@pytest.mark.slow
def test_the_loss_over_parts_of_positions_equals_reference(small_problem):
    """model.loss_parts=4: the loss over a quarter of each device's positions at a time, each quarter's gradient
    computed with its loss (train.cross_entropy_sum), is the same loss and gradients up to the order of sums."""
    cfg, *problem = small_problem
    assert_float32_equals_reference(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loss_parts=4)),
                                    *problem, 4, 2)


@pytest.mark.slow
@pytest.mark.parametrize("d,t", MESHES)
def test_float32_loss_and_gradients_equal_reference_on_every_mesh(problem, exact_reference, d, t):
    assert_float32_equals_reference(*problem[:3], *exact_reference, d, t)


@pytest.mark.slow
@pytest.mark.parametrize("d,t", [(1, 1), (2, 4)])
def test_bfloat16_loss_and_gradients_are_as_accurate_as_reference(problem, exact_reference, d, t):
    """With bfloat16 operands (the training precision) the loss matches the bfloat16 reference to
    1e-4, and each gradient is about as close to the exact one as the bfloat16 reference's is.
    The bound is the arithmetic's own: a gradient's error from bfloat16 rounding is its unit
    roundoff (2^-8) times its conditioning (how much its terms cancel, largest for a norm gain's
    gradient, a sum over every position), which any bfloat16 evaluation of the same math shares.
    The two round at a few different points (blockwise attention rounds unnormalized softmax
    weights, the reference normalized ones), so each of ours may be a little worse, never a whole
    bit of bfloat16's 8 worse: below twice the reference's error of the same gradient. Measured on
    this tiny model: 0.3-1.1e-2 from exact, 0.93-1.24x the reference's; with QK-norm's gains up to
    1.8e-2 and 1.55x (the reference's own k_norm error is 1.7e-2); on average within 1.2x of it."""
    cfg, weights, batch, ref_loss, ref_grads = problem
    _, exact_grads = exact_reference
    loss, grads = sharded_loss_and_grads(cfg, make_mesh(d, t), weights, batch)
    assert abs(float(loss) - ref_loss) <= 1e-4 * abs(ref_loss), (float(loss), ref_loss)
    ours = relative_errors(weights_to_dicts(grads, cfg.model.layers), exact_grads)
    reference = dict(relative_errors(ref_grads, exact_grads))
    for path, err in ours:
        assert err < 2 * reference[path], (
            f"gradient {path}: relative L2 error {err:.2e} from exact on mesh {d}x{t}, the bfloat16 reference's "
            f"{reference[path]:.2e}: a bit of precision lost")
    assert np.mean([err for _, err in ours]) < 1.2 * np.mean(list(reference.values())), (ours, reference)


@pytest.mark.slow
def test_float8_gradients_are_within_float8s_rounding_of_exact(problem, exact_reference):
    """model.matmul_dtype=float8 (the linear layers' and the unembedding's matmuls in e4m3, the layers' output
    gradients in e4m3 and the logits' in e5m2, each scaled by its amax or a bound; attention in bf16), on a 4x2
    mesh (each device scales its own blocks): a gradient's error is float8's unit roundoff times the same
    conditioning that the bfloat16 reference's error shows. The coarsest rounding in the chain, e5m2's of the
    logits' gradient (2^-3), which every gradient passes through, is 32x bfloat16's (2^-8), e4m3's (2^-4) 16x:
    each gradient's error is below 32x the bfloat16 reference's, and their mean below 20x its mean (16x and a
    quarter). The loss, a mean over the batch's tokens whose errors average out, within bfloat16's unit
    roundoff of exact. Measured on 1x1 and 4x2: 13.4-18.7x, the mean 15.4x bfloat16's (the layers' gradients
    in e5m2: 15.3-23.8x, 17.8x; the logits in bfloat16 too: 12.7-18.4x); the loss 1.2e-4."""
    cfg, weights, batch, _, ref_grads = problem
    exact_loss, exact_grads = exact_reference
    float8 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, matmul_dtype="float8"))
    loss, grads = sharded_loss_and_grads(float8, make_mesh(4, 2), weights, batch)
    assert abs(float(loss) / exact_loss - 1) < 2.0**-8, (float(loss), exact_loss)
    ours = relative_errors(weights_to_dicts(grads, cfg.model.layers), exact_grads)
    reference = dict(relative_errors(ref_grads, exact_grads))
    for path, err in ours:
        assert err < 32 * reference[path], f"gradient {path}: {err:.2e} from exact, {err / reference[path]:.1f}x bf16's"
    assert np.mean([err for _, err in ours]) < 20 * np.mean(list(reference.values())), (ours, reference)


def equations(jaxpr):
    """Every equation of jaxpr, its inner jaxprs' (a scan's body, a custom VJP's, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in (param if isinstance(param, (list, tuple)) else [param]):
                if isinstance(inner, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from equations(getattr(inner, "jaxpr", inner))


def reductions_of_shape(jaxpr, primitive: str, shape: tuple) -> int:
    """How many `primitive` equations of jaxpr (its inner jaxprs included) reduce an operand of `shape`."""
    return sum(eqn.primitive.name == primitive and tuple(eqn.invars[0].aval.shape) == shape for eqn in equations(jaxpr))


def model_loss_jaxpr(cfg, differentiated: bool):
    """The jaxpr of model_loss on a 4x2 mesh (shard_map), or of its value and gradient by the weights."""

    @typed_shard_map
    def loss(w: train.Model, targets: u32[b"B/d L/c"], starts: bool_[b"B/d L/c"], mask: bool_[b"B/d L/c"]) -> f32[b""]:
        return lax.psum(train.model_loss(cfg.model, 0.0, w, targets, starts, mask)[0], ("d", "c"))

    with jax.set_mesh(mesh := make_mesh(4, 2)):
        state = abstract_state(cfg, mesh)
        batch = [jax.ShapeDtypeStruct((cfg.training.tokens.batch, cfg.training.tokens.len), dtype)
                 for dtype in (jnp.uint32, bool, bool)]
        return jax.make_jaxpr(jax.value_and_grad(loss) if differentiated else loss)(state.weights, *batch).jaxpr


def value_shapes(jaxpr) -> set[tuple]:
    """The shape of every value jaxpr computes, its inner jaxprs' included."""
    return {tuple(v.aval.shape) for eqn in equations(jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape")}


def test_no_device_holds_the_whole_embedding_table_or_its_gradient():
    """FSDP without gathering the embedding (train.embed_tokens): on a 4x2 mesh the loss and its gradient never
    make a value of the table's shape on a device with M whole ([V/t, M]), only its shard [V/t, M/d]; the
    unembedding, which the loss multiplies whole, is gathered ([M, V/t])."""
    cfg = tiny_config("model.vocab=384")  # V/t = 192, M = 64: no other value has those shapes
    M, V = cfg.model.d_model, cfg.model.vocab
    shapes = value_shapes(model_loss_jaxpr(cfg, differentiated=True))
    assert (V // 2, M // 4) in shapes and (M, V // 2) in shapes, shapes
    assert (V // 2, M) not in shapes


def test_float8_scales_the_normed_stream_by_its_norms_bound_not_its_amax():
    """rms_norm_bound bounds every normed value (a one-hot row, which puts all of its norm on one element,
    reaches it up to eps), so float8 scales the normed stream by it: the forward pass takes no amax over the
    normed stream [B, L, M], whose cast the compiler can then make in the norm's own kernel; bfloat16 takes
    none either, and float8 still takes the amax of the attention's output and the SwiGLU's hidden values."""
    M, gain = 64, jnp.linspace(-3.0, 2.0, 64)
    bound = float(train.rms_norm_bound(gain))
    assert bound == pytest.approx(8 * 3.0)
    one_hot = jnp.zeros((1, M)).at[0, 0].set(1e3)  # on the gain's largest magnitude, -3
    assert float(jnp.max(jnp.abs(train.rms_norm(one_hot, gain, 1e-5)))) == pytest.approx(bound, rel=1e-9)
    rows = jax.random.normal(jax.random.key(0), (256, M)) * jnp.logspace(-3, 3, 256)[:, None]
    assert float(jnp.max(jnp.abs(train.rms_norm(rows, gain, 1e-5)))) <= bound

    def forward_reductions(*overrides: str) -> tuple[int, int, int]:
        cfg = tiny_config(*overrides)
        h, B, L = cfg.model, cfg.training.tokens.batch // 4, cfg.training.tokens.len
        jaxpr = model_loss_jaxpr(cfg, differentiated=False)
        shapes = [(B, L, h.d_model), (B, L, h.n_q_per_kv, h.n_kv // 2, h.d_head), (B, L, h.d_ff // 2)]
        return tuple(reductions_of_shape(jaxpr, "reduce_max", shape) for shape in shapes)

    wider = "model.d_ff=384"  # the hidden values [B, L, F/t] shaped as neither the normed stream nor the logits
    normed, attention_out, hidden = forward_reductions(wider, "model.matmul_dtype=float8")
    assert normed == 0 and attention_out > 0 and hidden > 0, (normed, attention_out, hidden)
    assert forward_reductions(wider) == (0, 0, 0)


def test_float8_scales_the_logits_gradient_by_the_losss_bound_not_its_amax(monkeypatch):
    """The loss's gradient by a logit is (softmax - one-hot) / the batch's real tokens, at most 1 / tokens:
    model_loss hands that bound down to the unembedding, so float8 scales the logits' gradient [B, L, V/t] by
    it and takes no amax over it: the value and gradient take as many maxima over the logits as bfloat16's
    (the cross-entropy's own max), and one more when the bound is not given. (The gradients' accuracy with
    the bound, which a bound too small would break by clipping the target's gradient: the test above.)"""
    def logit_maxima(*overrides: str) -> int:
        cfg = tiny_config(*overrides)
        shape = (cfg.training.tokens.batch // 4, cfg.training.tokens.len, cfg.model.vocab // 2)
        return reductions_of_shape(model_loss_jaxpr(cfg, differentiated=True), "reduce_max", shape)

    bfloat16, float8 = logit_maxima(), logit_maxima("model.matmul_dtype=float8")
    assert bfloat16 >= 1 and float8 == bfloat16, (bfloat16, float8)
    weighted_cross_entropy = train.weighted_cross_entropy  # below, without the bound
    monkeypatch.setattr(train, "weighted_cross_entropy", lambda *args: weighted_cross_entropy(*args[:6], None))
    assert logit_maxima("model.matmul_dtype=float8") == bfloat16 + 1


def float8_casts(jaxpr) -> set[tuple[str, tuple]]:
    """(type, shape) of every cast to a float8 type in jaxpr, its inner jaxprs' included."""
    outs = [eqn.outvars[0].aval for eqn in equations(jaxpr) if eqn.primitive.name == "convert_element_type"]
    return {(out.dtype.name, tuple(out.shape)) for out in outs
            if out.dtype.itemsize == 1 and jnp.issubdtype(out.dtype, jnp.floating)}


def test_float8_multiplies_the_logits_gradient_in_e5m2_and_everything_else_in_e4m3():
    """The layers' gradients in e4m3 (half e5m2's rounding), the logits' gradient [B, L, V/t] in e5m2, whose
    range keeps the softmax's tail: the value and gradient cast to e5m2 that one tensor and no other, the
    rest to e4m3 (einsum_unreduced's default: tests/test_float8.py)."""
    cfg = tiny_config("model.matmul_dtype=float8")
    logits = (cfg.training.tokens.batch // 4, cfg.training.tokens.len, cfg.model.vocab // 2)
    casts = float8_casts(model_loss_jaxpr(cfg, differentiated=True))
    assert {shape for dtype, shape in casts if dtype == "float8_e5m2"} == {logits}, casts
    assert {dtype for dtype, _ in casts} == {"float8_e4m3fn", "float8_e5m2"}, casts


def test_reference_loss_is_near_log_vocab_at_init(small_problem):
    """Guards the reference itself: a broken reference could agree with a broken model."""
    cfg, *_, ref_loss, _ = small_problem
    assert abs(ref_loss - np.log(cfg.model.vocab)) < 2.0


@pytest.mark.slow
def test_training_step_reports_reference_loss_and_grad_norm(problem):
    cfg, weights, batch, ref_loss, ref_grads = problem
    ref_norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(ref_grads)))
    mesh = make_mesh(4, 2)
    with jax.set_mesh(mesh):
        shardings = make_shardings(train.State, mesh)
        state = jax.jit(train.fresh_state, out_shardings=shardings)(weights)
        new_state, metrics = train.training_step(state, jnp.uint32(0), *put_batch(mesh, batch), cfg)
    assert abs(float(metrics.loss) - ref_loss) <= 1e-4 * ref_loss
    assert abs(float(metrics.grad_norm) - ref_norm) <= 1e-2 * ref_norm
    assert new_state.weights.embed.sharding == shardings.weights.embed
    assert not np.array_equal(np.asarray(new_state.weights.embed), weights.embed)


@pytest.mark.slow
def test_every_matmul_of_the_training_step_has_bf16_operands():
    """The forward's matmuls and both gradients of each (einsum_unreduced's backward) run with
    bf16 operands and f32 results: no float32 matmul anywhere in the compiled step, which
    plain autodiff of a bf16 x bf16 -> f32 product would give (several times slower)."""
    cfg, mesh = tiny_config(), make_mesh(4, 2)
    with jax.set_mesh(mesh):
        hlo = compile_step(train.training_step, cfg, abstract_state(cfg, mesh), mesh).as_text()
    types = {}  # instruction -> its element type, per computation (fused computations name their parameters)
    dots = []
    for line in hlo.splitlines():
        if not line.startswith(" "):
            types = {}
        match = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (\w+)\[", line)
        if match:
            types[match.group(1)] = match.group(2)
        dot = re.match(r"\s+(?:ROOT )?%[\w.\-]+ = (\w+)\[[^ ]* dot\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if dot:
            dots.append((dot.group(1), types.get(dot.group(2)), types.get(dot.group(3))))
    assert len(dots) > 20, dots  # every matmul weight's forward and its two gradients, and attention's
    assert all(dot == ("f32", "bf16", "bf16") for dot in dots), [dot for dot in dots if dot != ("f32", "bf16", "bf16")]
