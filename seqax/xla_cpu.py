"""Workarounds for XLA:CPU, one function each: the same values on every platform, computed in a way
that XLA:CPU compiles or runs faster (or, for materialized_transpose and in_default_layout, at all). The
GPU and TPU programs run as fast with or without each (docs/performance.md, "XLA:CPU notes" and "Muon's
same-shaped matrices", has the measurements)."""

import jax
import jax.numpy as jnp
from jax import lax


def normal_drawn_as(key, shape, drawn_shape):
    """Standard normal float32 values of `shape`, drawn as `drawn_shape` (the same number of elements,
    dimensions that no mesh axis splits merged into a neighbour) and reshaped: the same values, since
    threefry numbers elements in row-major order, but XLA:CPU compiles a rank-5 draw several times slower."""
    return jax.random.normal(key, drawn_shape, jnp.float32).reshape(shape)


def transposed_weight(w):
    """w [F, M] as [M, F] for a matmul that contracts F: for a weight's gradient XLA:CPU transposes the
    operand that gives the gradient's first dimension, and with [M, F] that is the small output
    gradient rather than the hidden activation (with its recomputation fused into the strided pass)."""
    return jnp.transpose(w)


def in_default_layout(x):
    """x, materialized behind an optimization barrier, so in the default (row-major) layout. XLA:CPU
    splits an all-to-all into one operand per device's block; where a block is a slice of a concatenation,
    its algebraic simplifier takes the concatenated array itself, and its layout assignment then lays a
    transposed one out as the untransposed (no copy): operands of different layouts, which the HLO
    verifier rejects."""
    return lax.optimization_barrier(x)


def materialized_transpose(x):
    """x [n, r, c] as [n, c, r], materialized behind an optimization barrier: XLA:CPU would otherwise fold
    the transpose of a stack of bfloat16 matrices into a batched dot that its runtime cannot run
    ("DotThunk: BF16 x BF16 = F32")."""
    return lax.optimization_barrier(jnp.swapaxes(x, 1, 2))
