"""Float8 with tensorwise scaling: the cast that einsum_unreduced(..., multiply_in="float8") does to each
operand of a matmul, and to the gradient of its output.

Hopper and Blackwell multiply float8 at twice bfloat16's rate, but float8 holds few values: e4m3 has 3
mantissa bits (a relative rounding of at most 2^-4) and nothing above 448; e5m2 has 2 (2^-3) and a
range up to 57344. So a tensor is multiplied by a scale before its cast, chosen from the largest
magnitude it holds now (its amax: "current" scaling, no history kept across steps) so that the amax
lands just under the type's largest value, and the product of two scaled operands, accumulated in
float32, is multiplied by both inverse scales. The forward's operands go to e4m3 (precision), and so,
by default, does the gradient of a matmul's output: e4m3's rounding is half e5m2's, and the range below
a tensor's scaled amax that it keeps (about 2^-17.8 of it) holds the layers' gradients (on local_test_text,
with them in e4m3 float8 trained within 0.6% of bfloat16 on four seeds, with them in e5m2 up to 1.1% above
it: docs/performance.md). The exception is the logits' gradient, mostly a softmax's tail far below its
largest value: e5m2, whose range keeps about 2^-31.8 of it (train.output_logits, einsum_unreduced's
gradient_float8). cuBLASLt's float8 GEMMs (what XLA calls on GPUs) multiply e4m3 x e4m3 and e4m3 x e5m2,
not e5m2 x e5m2: the backward's matmuls multiply the gradient by the forward's e4m3 operands.

grouped_swiglu (the experts) casts the same way, each expert's weights once and each block of rows on its
own (`operand`, `matmul`).

A scale is a power of two: multiplying by it only moves exponents, so the cast is the one rounding
and the inverse scale undoes the scale exactly. The amax is of what one device holds (a weight's
block after its gathers): each device's matmul is scaled on its own, and no collective is added.
"""

import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # the forward's operands and the layers' output gradients
E5M2 = jnp.float8_e5m2  # the logits' gradient


def scaled(x, dtype, amax=None):
    """(x x scale cast to `dtype`, 1 / scale): the scale the largest power of two that keeps x's amax
    within dtype's largest value (1 for a tensor of zeros or none; at most 2^100, so that the tiniest tensors
    do not overflow the scale). A non-finite amax gives a NaN result, as the matmul in bfloat16 would.

    `amax`, when given, is a bound on |x| known before x is computed (train.rms_norm_bound: the normed stream's,
    from its gain; train.model_loss's on the logits' gradient: 1 / the batch's tokens), used instead of x's
    own: no pass over x waits to find it, so the compiler can cast x in the kernel that computes it. Values a
    rounding puts above the bound are clipped to dtype's largest."""
    largest = float(jnp.finfo(dtype).max)
    if amax is None:
        amax = jnp.max(jnp.abs(x), initial=0)  # initial: an empty x (a model with d_ff 0) has 0
    amax = jnp.asarray(amax).astype(jnp.float32)
    exponent = jnp.floor(jnp.log2(largest / jnp.where(amax > 0, amax, largest)))
    scale = jnp.where(jnp.isfinite(amax), jnp.exp2(jnp.clip(exponent, -126, 100)), jnp.nan)
    # In x's own type: a power of two scales a bfloat16 exactly, and a float32 copy of x would be a
    # round trip the compiler may drop (a bfloat16 rounding before it with it). The clip catches a log2
    # rounded up by one ulp (amax x scale a hair above largest), which e4m3, having no infinity, would
    # cast to NaN.
    return jnp.clip(x * scale.astype(x.dtype), -largest, largest).astype(dtype), 1 / scale


def operand(x, dtype, float8: bool):
    """A matmul operand as `matmul` takes it: (x scaled and cast to `dtype`, its inverse scale) when float8,
    else (x, None), multiplied as it is."""
    return scaled(x, dtype) if float8 else (x, None)


def transposed(pair):
    """The transpose of a 2-D `operand`: the same scale (an amax does not depend on the order)."""
    return pair[0].T, pair[1]


def matmul(a, b):
    """a @ b of two `operand`s, accumulated in float32, the scales undone."""
    (a, a_inverse), (b, b_inverse) = a, b
    product = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    return product if a_inverse is None else product * (a_inverse * b_inverse)
