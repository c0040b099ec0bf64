"""shardlib/float8.py and einsum_unreduced(..., multiply_in="float8"): the scaled cast is one rounding to
e4m3 (or e5m2) by a power-of-two scale, as numpy's ml_dtypes rounds; a float8 matmul and both of its
gradients are within the bound that e4m3's precision gives (and e5m2's, for an output gradient asked for in
it), elementwise, on operands that e4m3 unscaled cannot hold (above 448, or below its smallest value); a
scale from a bound given for the amax (the normed stream's, train.rms_norm_bound) is that bound's, with
anything rounded past it clipped; a gradient type GPUs cannot multiply is refused."""

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from seqax.shardlib.float8 import E4M3, E5M2, scaled
from seqax.shardlib.shardops import SpecError, einsum_unreduced

# Half the spacing of each type's values, relative (normal numbers: 3 and 2 mantissa bits) and absolute
# (below the smallest normal number, in the scaled units): round-to-nearest is within these.
E4M3_RELATIVE, E4M3_ABSOLUTE = 2.0**-4, 2.0**-10
E5M2_RELATIVE, E5M2_ABSOLUTE = 2.0**-3, 2.0**-17


def test_the_scaled_cast_rounds_once_by_a_power_of_two():
    x = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32) * 3e4
    for dtype, numpy_type in ((E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)):
        values, inverse = (np.asarray(a) for a in scaled(jnp.asarray(x), dtype))
        scale = 1 / float(inverse)
        largest = float(ml_dtypes.finfo(numpy_type).max)
        assert np.log2(scale) == np.round(np.log2(scale))  # a power of two: x * scale is exact
        assert largest / 2 < np.max(np.abs(x)) * scale <= largest  # the amax lands in the top binade
        np.testing.assert_array_equal(values.view(np.uint8), (x * scale).astype(numpy_type).view(np.uint8))
    for shape in ((4, 4), (4, 0)):  # zeros, or none (the dense SwiGLU's weights of a model with d_ff 0)
        zeros, inverse = scaled(jnp.zeros(shape), E4M3)
        assert float(inverse) == 1.0 and zeros.shape == shape and not np.any(np.asarray(zeros, np.float32))
    for bad in (np.inf, np.nan):  # a non-finite tensor stays non-finite (as its bf16 matmul would be)
        values, _ = scaled(jnp.asarray([1.0, bad]), E4M3)
        assert np.all(np.isnan(np.asarray(values, np.float32)))


def test_a_bound_given_for_the_amax_sets_the_scale_and_a_value_rounded_past_it_is_clipped():
    """scaled(x, dtype, amax=bound): the scale is the bound's (its power of two, whatever x holds), the values
    under it are x x scale rounded once; a value past the bound (as a rounding may put one: a bfloat16 of a
    normed value) casts to e4m3's largest, not to NaN, which e4m3 gives for what it cannot hold."""
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32) * 300
    amax = float(np.max(np.abs(x)))
    values, inverse = (np.asarray(a) for a in scaled(jnp.asarray(x), E4M3, amax=jnp.float32(8 * amax)))
    scale = 1 / float(inverse)
    assert 448 / 2 < 8 * amax * scale <= 448 and scale == 1 / float(scaled(jnp.asarray(x), E4M3)[1]) / 8
    np.testing.assert_array_equal(values.view(np.uint8), (x * scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    past = np.array([448.0, -448.0 * 1.1], np.float32)  # the bound 448, the second past it
    clipped, inverse = (np.asarray(a, np.float32) for a in scaled(jnp.asarray(past), E4M3, amax=jnp.float32(448)))
    assert float(inverse) == 1.0 and list(clipped) == [448.0, -448.0]
    assert np.isnan(past.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)[1])  # unclipped: NaN


def bound(a, b, letters: str, relative_a, absolute_a, relative_b, absolute_b):
    """The largest error, elementwise, of einsum(letters) of a and b each rounded to within relative x |value|
    + absolute: |ea| |b| + |a| |eb| + |ea| |eb|, plus float32's accumulation (2^-24 a term)."""
    ea, eb = relative_a * np.abs(a) + absolute_a, relative_b * np.abs(b) + absolute_b
    terms = [np.einsum(letters, x, y) for x, y in ((ea, np.abs(b)), (np.abs(a), eb), (ea, eb))]
    return sum(terms) + 2.0**-24 * a.shape[-1] * np.einsum(letters, np.abs(a) + ea, np.abs(b) + eb)


def converted(jaxpr):
    """The outputs of every convert_element_type in jaxpr, its inner jaxprs' included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            yield eqn.outvars[0]
        for param in eqn.params.values():
            for inner in (param if isinstance(param, (list, tuple)) else [param]):
                if isinstance(inner, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from converted(getattr(inner, "jaxpr", inner))


GRADIENT_ROUNDING = {E4M3: (E4M3_RELATIVE, E4M3_ABSOLUTE), E5M2: (E5M2_RELATIVE, E5M2_ABSOLUTE)}


@pytest.mark.parametrize("gradient_type", [E4M3, E5M2], ids=["e4m3 gradient", "e5m2 gradient"])
def test_a_float8_matmul_and_its_gradients_are_within_float8s_rounding_where_e4m3_alone_fails(gradient_type):
    """Operands of 1e4 (e4m3's largest is 448) and 1e-6 (its smallest, 2^-9), a gradient of 1e-8: unscaled,
    the cast would give NaN and zeros; scaled, the product is within e4m3's rounding of the exact one, and
    each gradient within the output gradient's type's rounding (gradient_float8: e4m3, the default, or e5m2)
    and e4m3's (the other operand)."""
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((32, 96)) * 1e4).astype(np.float32)
    b = (rng.standard_normal((96, 40)) * 1e-6).astype(np.float32)
    g = (rng.standard_normal((32, 40)) * 1e-8).astype(np.float32)
    assert not np.all(np.isfinite(a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)))  # unscaled: overflow
    chosen = {} if gradient_type is E4M3 else {"gradient_float8": gradient_type}  # e4m3 by default
    y, vjp = jax.vjp(lambda x, w: einsum_unreduced("B M, M F -> B F", x, w, multiply_in="float8", **chosen), a, b)
    da, db = vjp(jnp.asarray(g))
    a64, b64, g64 = (x.astype(np.float64) for x in (a, b, g))
    scale_of = {name: 1 / float(scaled(jnp.asarray(x), t)[1]) for name, x, t in (("a", a, E4M3), ("b", b, E4M3),
                                                                                  ("g", g, gradient_type))}
    G_RELATIVE, G_ABSOLUTE = GRADIENT_ROUNDING[gradient_type]
    checks = [
        ("output", np.asarray(y), a64 @ b64,
         bound(a64, b64, "ij,jk->ik", E4M3_RELATIVE, E4M3_ABSOLUTE / scale_of["a"], E4M3_RELATIVE,
               E4M3_ABSOLUTE / scale_of["b"])),
        ("gradient of a", np.asarray(da), g64 @ b64.T,
         bound(g64, b64.T, "ij,jk->ik", G_RELATIVE, G_ABSOLUTE / scale_of["g"], E4M3_RELATIVE,
               E4M3_ABSOLUTE / scale_of["b"])),
        ("gradient of b", np.asarray(db), a64.T @ g64,
         bound(a64.T, g64, "ij,jk->ik", E4M3_RELATIVE, E4M3_ABSOLUTE / scale_of["a"], G_RELATIVE,
               G_ABSOLUTE / scale_of["g"])),
    ]
    # the output's gradient is multiplied in the type asked for (the weight in e4m3, cast again)
    casts = {(var.aval.dtype, var.aval.shape) for var in converted(jax.make_jaxpr(vjp)(jnp.asarray(g)).jaxpr)}
    float8 = {(dtype, shape) for dtype, shape in casts if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)}
    assert {dtype for dtype, _ in float8} == {jnp.dtype(gradient_type), jnp.dtype(E4M3)}, casts
    assert {dtype for dtype, shape in float8 if shape == g.shape} == {jnp.dtype(gradient_type)}, casts
    for name, ours, exact, limit in checks:
        error = np.abs(ours - exact)
        assert np.all(error <= limit), f"{name}: error {np.max(error / limit):.2f}x its bound"
        # and float8's rounding, not a wider type's: measured 0.045-0.082 of the worst case, with either gradient
        # type (the errors of a sum partly cancel); bf16's, 16x finer, would give about 0.003
        share = np.linalg.norm(error) / np.linalg.norm(limit)
        assert share > 0.01, (name, share)


def test_a_gradient_type_gpus_cannot_multiply_is_refused():
    """gradient_float8 other than e4m3 or e5m2 (what Hopper multiplies by an e4m3 operand) fails at trace
    time with a one-line error naming it, before any cast."""
    with pytest.raises(SpecError, match=r"gradient_float8 must be e4m3 or e5m2 .*, not bfloat16"):
        einsum_unreduced("B M, M F -> B F", jnp.ones((2, 3)), jnp.ones((3, 4)), multiply_in="float8",
                         gradient_float8=jnp.bfloat16)
