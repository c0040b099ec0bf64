"""Floats narrower than 32 bits (bfloat16, float16, the float8 types) moved as their bits on CPUs.

XLA:CPU widens such an array to float32 wherever a collective sends it, a loop slices it or a
stacked save updates it in place: twice the bytes on the wire and a float32 copy of the whole
stack for every slice. An unsigned integer of the same width is a plain copy to it. Elsewhere the
float moves as it is: a TPU runs its all-gathers and reduce-scatters on its SparseCores, beside the
TensorCores, only when they carry floats (as unsigned integers they stay on the TensorCores,
synchronous: tpu256_8b's exposed communication 3.6x, docs/performance.md).
"""

import jax.numpy as jnp
from jax import lax

from seqax.shardlib.shardtypes import traced_device


def is_narrow_float(x) -> bool:
    """Whether x is a float of fewer than 32 bits, which XLA:CPU widens where it moves or slices it."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4


def through_bits(f, x):
    """f(x), computed on x's bit pattern when x is a narrow float traced for a CPU: f gets x bitcast to the
    unsigned integer of its width and its result is bitcast back to x's dtype. `f` must only move data
    (collectives, slices, updates, naming), never compute with it. Other dtypes and platforms: f(x)."""
    if not is_narrow_float(x) or traced_device()[0] != "cpu":
        return f(x)
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return lax.bitcast_convert_type(f(bits), x.dtype)
