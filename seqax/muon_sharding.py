"""Muon's sharding mechanics (train.muon_update holds the rule): which weights of a layer are matrices,
read off their annotations; the spec that spreads a stack of layers over every device so that each holds
whole matrices; and running an orthogonalization on the matrices a device holds.

A layer weight is a matrix when its dimensions, experts (E) aside, are d_model (M) and at least one other:
its rows are M and its columns the rest (w_q: [M, Q K D]), or the rest and M when M comes last (w_o:
[Q K D, M]). E stacks one matrix per expert. A gain or a bias ([M], [E]) is no matrix, and neither is the
router ([M, E]: a vector of M for each expert).
"""

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from seqax.shardlib.shardtypes import dims_str, leaf_dims
from seqax.xla_cpu import materialized_transpose

MATRIX_ROWS = "M"  # the dimension a layer's matrices are orthogonalized against
STACK = "E"  # a dimension that stacks matrices (one per expert)


def layer_matrices(layer) -> dict[str, tuple[str, tuple[int, int]]]:
    """{weight name: (spread spec, (rows, cols))} of the matrices among the fields of the pytree dataclass
    `layer` (train.Layer): the spec moves the stack of layers ("layers" first, as the Model stacks them)
    from the weight's sharding to all devices, each holding whole matrices (its inverse brings them back);
    rows and cols count the last dimensions that make the matrix's rows and columns (those before are a
    stack of matrices)."""
    matrices = {}
    for field, dims in zip(dataclasses.fields(layer), leaf_dims(layer), strict=True):
        names = [d.name for d in dims]
        inner = [n for n in names if n != STACK]
        if MATRIX_ROWS not in inner or len(inner) < 2:
            continue
        m = inner.index(MATRIX_ROWS)
        if m not in (0, len(inner) - 1) or names[len(names) - len(inner):] != inner:
            raise ValueError(f"{layer.__name__}.{field.name} [{dims_str(dims)}]: a matrix's stack ({STACK}) must come "
                             f"first and {MATRIX_ROWS} first or last after it, so that its rows and columns are "
                             "contiguous")
        matrix = (1, len(inner) - 1) if m == 0 else (len(inner) - 1, 1)
        spread = f"layers {dims_str(dims)} -> layers/d/c/t {' '.join(names)}"
        matrices[field.name] = (spread, matrix)
    return matrices


def padded_to_devices(stack, devices: int):
    """A stack of layers [layers, ...] padded with zero layers to a multiple of `devices`, so that the
    spread gives each device the same number."""
    return jnp.pad(stack, [(0, -stack.shape[0] % devices)] + [(0, 0)] * (stack.ndim - 1))


def matrix_shape(whole, matrix: tuple[int, int]) -> tuple[int, int]:
    """(fan_in, fan_out) of the matrices of `whole` [..., rows dims, cols dims]."""
    rows, cols = matrix
    return math.prod(whole.shape[-rows - cols : -cols]), math.prod(whole.shape[-cols:])


def orthogonalized_here(orthogonalize, whole, matrix: tuple[int, int], layers: int, dtype):
    """orthogonalize(matrices [n, r, c], r <= c) -> float32, applied to the whole matrices this device
    holds after the spread (`whole` [layers / devices, ...]); a tall matrix goes as its transpose. A
    device that holds only padding layers (past `layers`) skips the work. Returns `dtype`, shaped as whole."""
    fan_in, fan_out = matrix_shape(whole, matrix)
    rows, cols = matrix
    matrices = whole.reshape(math.prod(whole.shape[: -rows - cols]), fan_in, fan_out)

    def wide(x):
        return materialized_transpose(x) if fan_in > fan_out else x

    def skip(matrices):
        return jnp.zeros_like(matrices, jnp.float32)

    first = lax.axis_index(("d", "c", "t")) * whole.shape[0]
    update = wide(lax.cond(first < layers, orthogonalize, skip, wide(matrices)).astype(dtype))
    return update.reshape(whole.shape)
