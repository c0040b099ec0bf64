"""SwiGLU feed-forward layers, one per group of rows (a mixture of experts' experts), computing only
the blocks of rows that exist.

The rows x [N, M] are listed in blocks of b by `rows` [n, b] (indices into x; N itself marks a
padding place), each group's blocks contiguous: group g owns blocks ends[g - 1] .. ends[g] - 1
(ends[-1] = 0); the blocks after the last group's are empty. How many blocks a group has is known
only at run time, so each group is a loop over its own blocks (a while loop whose trip count is
data), and one iteration is a whole SwiGLU on one block: its rows gathered from x, the gate and up
matmuls, silu(gate) * up, the down matmul, the results written over those rows of x. Nothing is
computed for blocks that do not exist, and no array of all n blocks' hidden activations is made:
the work and the memory traffic follow the rows, whatever bound n is sized for. Nor is a second
array of N rows: the output is x's own buffer (and the input gradient the output gradient's), so
that a caller whose N is a worst case (train.experts_block) zero-fills none.

The math is train.py's dense SwiGLU (transformer_layer): gate and up rounded to the operands' dtype,
silu(gate) * up in float32, rounded once, the down matmul's partial sums in float32, rounded once
to x's dtype (the dense SwiGLU keeps them in float32: here they are the output, in x's buffer).

multiply_in="float8" (model.matmul_dtype) multiplies as einsum_unreduced does (shardlib/float8.py): each
expert's three weights cast to e4m3 once, each block's rows and hidden activations by their own amax (finer
than one scale for all rows: a block holds one expert's rows), the gradients of a block's outputs to e4m3 too
(as the dense layers').

JAX cannot differentiate a loop of data-dependent length in reverse, so the gradient is written out
(custom_vjp): the same loops recompute each block's gate, up and hidden values and give its rows'
input gradient and its group's weight gradients, accumulated in float32.

A roofline cannot read a data-dependent trip count from the program: each loop is named (in its HLO
op_name) with the caller's expectation, `expected_trips=N` (trips_name), which roofline.py uses.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from seqax.shardlib.float8 import E4M3, matmul, operand, transposed
from seqax.shardlib.shardops import zeros_after


def trips_name(trips: int) -> str:
    """The name scope that tells a roofline how many times the loop inside it is expected to run."""
    return f"expected_trips={trips}"


def grouped_swiglu(x, rows, gate_w, up_w, down_w, ends, expected_blocks: int, multiply_in: str | None = None):
    """x [N, M] (the operands' dtype: bfloat16, or float32 for exact checks); rows [n, b] int32;
    gate_w, up_w [G, M, H]; down_w [G, H, M]; ends int32 [G]. Returns [N, M] in x's dtype: each listed row's
    SwiGLU by its group's weights; rows no block lists are x's, unchanged. expected_blocks: the blocks a group
    is expected to hold (a static int, read by the roofline only). multiply_in: "float8" casts each matmul's
    operands (above); anything else multiplies x's dtype as it is."""
    G, M, H = gate_w.shape
    if (x.ndim != 2 or x.shape[1] != M or rows.ndim != 2 or up_w.shape != gate_w.shape
            or down_w.shape != (G, H, M) or ends.shape != (G,)):
        raise ValueError(f"grouped_swiglu: x [N, M], rows [n, b], gate_w and up_w [G, M, H], down_w [G, H, M] "
                         f"and ends [G] needed, got x {x.shape}, rows {rows.shape}, gate_w {gate_w.shape}, "
                         f"up_w {up_w.shape}, down_w {down_w.shape}, ends {ends.shape}")
    return _grouped_swiglu(x, rows.astype(jnp.int32), gate_w, up_w, down_w, ends.astype(jnp.int32), expected_blocks,
                           multiply_in == "float8")


def _group_loop(ends, g: int, expected_blocks: int, body, carry):
    """body(block, carry) -> carry over group g's blocks."""
    start = ends[g - 1] if g else jnp.int32(0)
    with jax.named_scope(trips_name(expected_blocks)):
        return lax.fori_loop(start, ends[g], body, carry)


def _weights(gate_w, up_w, down_w, g: int, float8: bool):
    """Group g's three weights as matmul operands: sliced (and cast) once, outside its loop."""
    return tuple(operand(w[g], E4M3, float8) for w in (gate_w, up_w, down_w))


def _hidden(x_block, gate_w, up_w, float8: bool):
    """(x_block as a matmul operand, gate as float32 after rounding, up, the hidden activations) of one
    block, as the dense SwiGLU."""
    x8 = operand(x_block, E4M3, float8)
    gate = matmul(x8, gate_w).astype(x_block.dtype).astype(jnp.float32)
    up = matmul(x8, up_w).astype(x_block.dtype)
    return x8, gate, up, (gate * jax.nn.sigmoid(gate) * up).astype(x_block.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _grouped_swiglu(x, rows, gate_w, up_w, down_w, ends, expected_blocks, float8):
    # The output is x's buffer, each block's rows overwritten where they were read: blocks list
    # disjoint rows, so a block never reads a row another has written (a padding place may: its
    # result is dropped; it counts in its block's amax, a row of x or of an output, finite).
    # No second buffer of N rows is made or zeroed.
    out = x
    for g in range(ends.shape[0]):
        weights = _weights(gate_w, up_w, down_w, g, float8)

        def block(i, out, weights=weights):
            gate_w, up_w, down_w = weights
            at = rows[i]
            hidden = _hidden(out.at[at].get(mode="clip"), gate_w, up_w, float8)[3]
            y = matmul(operand(hidden, E4M3, float8), down_w).astype(out.dtype)
            return out.at[at].set(y, mode="drop")

        out = _group_loop(ends, g, expected_blocks, block, out)
    return out


def _forward(x, rows, gate_w, up_w, down_w, ends, expected_blocks, float8):
    return (_grouped_swiglu(x, rows, gate_w, up_w, down_w, ends, expected_blocks, float8),
            (x, rows, gate_w, up_w, down_w, ends))


def _backward(expected_blocks, float8, residuals, d_out):
    x, rows, gate_w, up_w, down_w, ends = residuals
    operands = (x, rows, gate_w, up_w, down_w, ends, d_out)
    # dx is d_out's buffer, each block's rows overwritten after they were read (as the forward): a row
    # no block lists passes through, its gradient its own.
    dx = d_out
    weight_grads = []
    for g in range(ends.shape[0]):
        weights = _weights(gate_w, up_w, down_w, g, float8)

        def block(i, carry, weights=weights):
            gate_w, up_w, down_w = weights
            dx, d_gate_w, d_up_w, d_down_w = carry
            at = rows[i]
            x8, gate, up, hidden = _hidden(x.at[at].get(mode="clip"), gate_w, up_w, float8)
            # A padding place reads some row of x (clipped: no mask), but its dy is 0, so it adds nothing.
            dy = operand(dx.at[at].get(mode="fill", fill_value=0), E4M3, float8)
            d_down_w += matmul(transposed(operand(hidden, E4M3, float8)), dy)
            d_hidden = matmul(dy, transposed(down_w))
            sig = jax.nn.sigmoid(gate)
            d_gate = (d_hidden * up * sig * (1 + gate * (1 - sig))).astype(x.dtype)  # silu'(g) = s (1 + g (1 - s))
            d_up = (d_hidden * gate * sig).astype(x.dtype)
            d_gate, d_up = operand(d_gate, E4M3, float8), operand(d_up, E4M3, float8)
            d_gate_w += matmul(transposed(x8), d_gate)
            d_up_w += matmul(transposed(x8), d_up)
            dx_block = matmul(d_gate, transposed(gate_w)) + matmul(d_up, transposed(up_w))
            return dx.at[at].set(dx_block.astype(x.dtype), mode="drop"), d_gate_w, d_up_w, d_down_w

        zeros = tuple(zeros_after(w.shape[1:], jnp.float32, *operands) for w in (gate_w, up_w, down_w))
        dx, *grads = _group_loop(ends, g, expected_blocks, block, (dx, *zeros))
        weight_grads.append(grads)
    d_gate_w, d_up_w, d_down_w = (jnp.stack(grads).astype(w.dtype) for grads, w in
                                  zip(zip(*weight_grads), (gate_w, up_w, down_w)))
    return dx, None, d_gate_w, d_up_w, d_down_w, None


_grouped_swiglu.defvjp(_forward, _backward)
