"""Muon's sharding mechanics (train.muon_update holds the rule): which weights of a layer are matrices,
read off their annotations; which of them share one shape once M comes first, and so go together; the
spec that spreads a stack of layers over every device so that each holds whole matrices; and running an
orthogonalization on the matrices a device holds.

A layer weight is a matrix when its dimensions, experts (E) aside, are d_model (M) and at least one other:
its rows are M and its columns the rest (w_q: [M, Q K D]), or the rest and M when M comes last (w_o:
[Q K D, M]). E stacks one matrix per expert. A gain or a bias ([M], [E]) is no matrix, and neither is the
router ([M, E]: a vector of M for each expert).

Orthogonalizing commutes with transposing (U V^T of G^T is V U^T), so a weight with M last is
orthogonalized as its transpose, M first: w_o [Q K D, M] then has w_q's shape [M, Q K D], and the two
weights' layers can go to the devices as one stack, one spread and one orthogonalization for both. With
few layers and many devices that matters: on 256 devices, 32 layers of seven weights spread one weight at
a time keep 32 devices busy seven times over; in three groups (q with o, k with v, gate and up with down),
64 or 96 devices three times. With as many layers as devices or more, a group would only give each
device more matrices at once: weights go together only while no device gets more to orthogonalize
(matrix_groups).
"""

import dataclasses
import math
import typing

import jax.numpy as jnp
from jax import lax

from seqax.shardlib.shardtypes import dims_str, leaf_dims
from seqax.xla_cpu import in_default_layout, materialized_transpose

MATRIX_ROWS = "M"  # the dimension a layer's matrices are orthogonalized against
STACK = "E"  # a dimension that stacks matrices (one per expert)


class LayerMatrix(typing.NamedTuple):
    """How Muon handles one layer weight that is a matrix, M first (transposed where M comes last)."""

    spread: str  # the spec that moves the stack of layers ("layers" first, as the Model stacks them), M first,
    # from the weight's sharding to all devices, each holding whole matrices (its inverse brings them back)
    matrix: tuple[int, int]  # how many of the last dimensions, M first, make the rows (M: 1) and the columns
    m_last: bool  # whether the weight holds M last: moved first (rows_first) before the spread, back after it


def layer_matrices(layer) -> dict[str, LayerMatrix]:
    """{weight name: LayerMatrix} of the matrices among the fields of the pytree dataclass `layer`
    (train.Layer). Weights with the same spread have the same shape, M first (matrix_groups)."""
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
        stack, m_last = len(names) - len(inner), m > 0
        if m_last:  # M moved in front of the columns
            dims, names = dims[:stack] + dims[-1:] + dims[stack:-1], names[:stack] + names[-1:] + names[stack:-1]
        spread = f"layers {dims_str(dims)} -> layers/d/c/t {' '.join(names)}"
        matrices[field.name] = LayerMatrix(spread, (1, len(inner) - 1), m_last)
    return matrices


def matrix_groups(muon: dict[str, LayerMatrix], layers: int, devices: int) -> list[list[str]]:
    """The names of `muon` (train.MUON) in groups that share one spread, so one shape M first, and whose
    `layers` layers each go to the `devices` devices as one stack: as many weights as fill the
    ceil(layers / devices) layers a device would hold of one weight alone, so that no device orthogonalizes
    more matrices at once than for one weight (on one device, every weight alone; the stack itself, the
    group's weights side by side before the spread, is a copy more). In `muon`'s order."""
    size = max(1, -(-layers // devices) * devices // max(layers, 1))  # weights a group holds at most
    shapes = {}
    for name, matrix in muon.items():
        shapes.setdefault(matrix.spread, []).append(name)
    return [names[i : i + size] for names in shapes.values() for i in range(0, len(names), size)]


def matrices_of(shape: tuple[int, ...], matrix: LayerMatrix) -> tuple[int, int, int]:
    """(how many, rows, cols) of the matrices, M first, of a weight of one layer shaped `shape` (as stored)."""
    cols = matrix.matrix[1]
    stack, dims = shape[: -1 - cols], shape[-1 - cols :]
    m = dims[-1] if matrix.m_last else dims[0]
    return math.prod(stack), m, math.prod(dims) // m


def rows_first(stack, matrix: LayerMatrix):
    """A stacked weight's local block [layers, ...] with M in front of the matrix's columns, as `matrix.spread`
    reads it (unchanged where M is first already)."""
    return jnp.moveaxis(stack, -1, -1 - matrix.matrix[1]) if matrix.m_last else stack


def rows_back(stack, matrix: LayerMatrix):
    """rows_first's inverse: M back where the weight holds it."""
    return jnp.moveaxis(stack, -1 - matrix.matrix[1], -1) if matrix.m_last else stack


def one_stack(stacks: list, devices: int):
    """Stacks of layers [layers, ...] of one shape, concatenated and padded with zero layers to a multiple of
    `devices`, so that the spread gives each device the same number. Materialized in the default layout:
    XLA:CPU splits an all-to-all into one operand per device's block, and where a block is a transposed
    weight (rows_first) it would keep that weight in another layout than the rest (xla_cpu.in_default_layout)."""
    stack = jnp.concatenate(stacks)
    return in_default_layout(jnp.pad(stack, [(0, -stack.shape[0] % devices)] + [(0, 0)] * (stack.ndim - 1)))


def matrix_shape(whole, matrix: tuple[int, int]) -> tuple[int, int]:
    """(rows, cols) of the matrices of `whole` [..., rows dims, cols dims] (M first: fans() says which is fan_in)."""
    rows, cols = matrix
    return math.prod(whole.shape[-rows - cols : -cols]), math.prod(whole.shape[-cols:])


def fans(whole, matrix: LayerMatrix) -> tuple[int, int]:
    """(fan_in, fan_out) of the weight whose matrices `whole` holds M first: the other way round where the
    weight holds M last (w_o [Q K D, M] maps the heads' outputs to M)."""
    rows, cols = matrix_shape(whole, matrix.matrix)
    return (cols, rows) if matrix.m_last else (rows, cols)


def orthogonalized_here(orthogonalize, whole, matrix: tuple[int, int], layers: int, dtype):
    """orthogonalize(matrices [n, r, c], r <= c) -> float32, applied to the whole matrices this device
    holds after the spread (`whole` [layers / devices, ...]); a tall matrix goes as its transpose. A
    device that holds only padding layers (past `layers`) skips the work. Returns `dtype`, shaped as whole."""
    r, c = matrix_shape(whole, matrix)
    matrices = whole.reshape(math.prod(whole.shape[: -sum(matrix)]), r, c)

    def wide(x):
        return materialized_transpose(x) if r > c else x

    def skip(matrices):
        return jnp.zeros_like(matrices, jnp.float32)

    first = lax.axis_index(("d", "c", "t")) * whole.shape[0]
    update = wide(lax.cond(first < layers, orthogonalize, skip, wide(matrices)).astype(dtype))
    return update.reshape(whole.shape)
