"""Flash attention for GPUs: flash_blocks.py's algorithm as Pallas kernels for the Triton lowering
(interpret mode on a CPU).

One program per (row b, kv head h, query block n) for the forward pass and dq, one per (b, h,
key block j) for dk and dv; each loops over its run of blocks with lax.fori_loop. Triton programs
are independent, so a reduction over blocks is a loop inside one program, not a grid axis. The
key and value refs span the whole sequence ([S, D] of head h): on a GPU a BlockSpec block is only
a pointer, and each loop step loads the block it needs. q, k and v are read in the model's layout
([B, L, Q, K, D]: a [block_q, Q, D] block is a strided load with each head's rows contiguous), so
nothing is transposed in memory. Grouped-query heads: a program loads a key and value block once
and uses it for all Q query heads of its kv head (a static loop over heads, Q accumulators).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqax.analysis.roofline import stated_flops
from seqax.kernels.flash_blocks import (
    F32,
    Tiling,
    check_shapes,
    dkv_step,
    dq_step,
    key_block_ranges,
    matmul_flops,
    output,
    query_block_ranges,
    softmax_finish,
    softmax_init,
    softmax_step,
    visible,
)


def _forward_kernel(ranges_ref, q_ref, k_ref, v_ref, q_pos_ref, q_doc_ref, k_pos_ref, k_doc_ref, o_ref, lse_ref, *,
                    block_k: int, scale: float):
    """One query block [block_q, Q, D] of kv head h against its run of key blocks."""
    block_q, heads, head_dim = q_ref.shape
    q_position, q_doc_start = q_pos_ref[...][:, None], q_doc_ref[...][:, None]  # columns [block_q, 1]
    queries = [q_ref[:, h, :] for h in range(heads)]

    def add_key_block(j, carry):
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]  # read once for all heads of the group
        mask = visible(q_position, q_doc_start, k_pos_ref[keys][None, :], k_doc_ref[keys][None, :])
        return tuple(softmax_step(c, q, k, v, mask, scale) for q, c in zip(queries, carry))

    init = tuple(softmax_init(block_q, head_dim) for _ in range(heads))
    carry = lax.fori_loop(ranges_ref[0], ranges_ref[1], add_key_block, init)
    for h in range(heads):
        o, lse = softmax_finish(carry[h])
        o_ref[:, h, :] = o.astype(o_ref.dtype)
        lse_ref[:, h] = lse.reshape(block_q)


def _dq_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, q_doc_ref, k_pos_ref,
               k_doc_ref, dq_ref, *, block_k: int, scale: float):
    """dq of one query block [block_q, Q, D] over the forward pass's run of key blocks."""
    block_q, heads, head_dim = q_ref.shape
    q_position, q_doc_start = q_pos_ref[...][:, None], q_doc_ref[...][:, None]
    queries = [q_ref[:, h, :] for h in range(heads)]
    d_outs = [do_ref[:, h, :] for h in range(heads)]
    lses = [lse_ref[:, h][:, None] for h in range(heads)]
    deltas = [delta_ref[:, h][:, None] for h in range(heads)]

    def add_key_block(j, dqs):
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = visible(q_position, q_doc_start, k_pos_ref[keys][None, :], k_doc_ref[keys][None, :])
        return tuple(dq_step(dqs[h], queries[h], d_outs[h], lses[h], deltas[h], k, v, mask, scale)
                     for h in range(heads))

    init = tuple(jnp.zeros((block_q, head_dim), F32) for _ in range(heads))
    dqs = lax.fori_loop(ranges_ref[0], ranges_ref[1], add_key_block, init)
    for h in range(heads):
        dq_ref[:, h, :] = (dqs[h] * scale).astype(dq_ref.dtype)


def _dkv_kernel(ranges_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, q_pos_ref, q_doc_ref, k_pos_ref,
                k_doc_ref, dk_ref, dv_ref, *, block_q: int, scale: float):
    """dk and dv of one key block [block_k, D] of kv head h: over the run of query blocks that
    visit it and, in each, over the Q query heads of the group, into one float32 dk and dv (no
    atomics: each program owns its output block, so the sums' order is fixed)."""
    block_k, head_dim = k_ref.shape
    heads = q_ref.shape[1]
    k, v = k_ref[...], v_ref[...]
    k_position, k_doc_start = k_pos_ref[...][:, None], k_doc_ref[...][:, None]  # keys as columns [block_k, 1]

    def add_query_block(n, dk_dv):
        rows = pl.ds(pl.multiple_of(n * block_q, block_q), block_q)
        mask_t = visible(q_pos_ref[rows][None, :], q_doc_ref[rows][None, :], k_position, k_doc_start)
        for h in range(heads):
            dk_dv = dkv_step(*dk_dv, k, v, q_ref[rows, h, :], do_ref[rows, h, :], lse_ref[rows, h][None, :],
                             delta_ref[rows, h][None, :], mask_t, scale)
        return dk_dv

    init = (jnp.zeros((block_k, head_dim), F32), jnp.zeros((block_k, head_dim), F32))
    dk, dv = lax.fori_loop(ranges_ref[0], ranges_ref[1], add_query_block, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(tiling: Tiling) -> dict:
    return dict(compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
                interpret=tiling.interpret)


def forward(q, k, v, q_doc_start, k_doc_start, q_position, k_position, tiling: Tiling, o_dtype):
    """(o [B, L, Q, K, D] in o_dtype, lse [B, L, Q, K] float32) of q over k, v [B, S, K, D];
    doc starts [B, L] and [B, S], positions [L] and [S], int32."""
    B, L, Q, K, D, S = check_shapes(q, k, tiling)
    bq, bk = tiling.block_q, tiling.block_k
    q_spec = pl.BlockSpec((None, bq, Q, None, D), lambda b, h, n: (b, n, 0, h, 0))
    kv_spec = pl.BlockSpec((None, S, None, D), lambda b, h, n: (b, 0, h, 0))
    with jax.named_scope(stated_flops(matmul_flops(B, L, Q, K, D, S, tiling, matmuls=2))):  # QK^T, PV
        return pl.pallas_call(
            functools.partial(_forward_kernel, block_k=bk, scale=D**-0.5),
            grid=(B, K, L // bq),
            in_specs=[pl.BlockSpec((None, None, 2), lambda b, h, n: (b, n, 0)), q_spec, kv_spec, kv_spec,
                      pl.BlockSpec((bq,), lambda b, h, n: (n,)), pl.BlockSpec((None, bq), lambda b, h, n: (b, n)),
                      pl.BlockSpec((S,), lambda b, h, n: (0,)), pl.BlockSpec((None, S), lambda b, h, n: (b, 0))],
            out_specs=[q_spec, pl.BlockSpec((None, bq, Q, None), lambda b, h, n: (b, n, 0, h))],
            out_shape=[output(q, q.shape, o_dtype), output(q, (B, L, Q, K), F32)],
            name="flash_forward", **_params(tiling),
        )(query_block_ranges(q_doc_start, q_position, k_position, bq, bk), q, k, v, q_position, q_doc_start,
          k_position, k_doc_start)


def backward(q, k, v, do, lse, delta, q_doc_start, k_doc_start, q_position, k_position, tiling: Tiling, grad_dtype):
    """(dq, dk, dv) in grad_dtype, by two kernels: dq over key blocks, dk and dv over query blocks.
    lse and delta [B, L, Q, K] float32 (flash_blocks.dq_step)."""
    B, L, Q, K, D, S = check_shapes(q, k, tiling)
    bq, bk = tiling.block_q, tiling.block_k
    scale = D**-0.5
    ints = (q_position, q_doc_start, k_position, k_doc_start)
    int_specs = [pl.BlockSpec((bq,), lambda b, h, n: (n,)), pl.BlockSpec((None, bq), lambda b, h, n: (b, n)),
                 pl.BlockSpec((S,), lambda b, h, n: (0,)), pl.BlockSpec((None, S), lambda b, h, n: (b, 0))]
    q_block = pl.BlockSpec((None, bq, Q, None, D), lambda b, h, n: (b, n, 0, h, 0))
    stat_block = pl.BlockSpec((None, bq, Q, None), lambda b, h, n: (b, n, 0, h))
    kv_whole = pl.BlockSpec((None, S, None, D), lambda b, h, n: (b, 0, h, 0))
    with jax.named_scope(stated_flops(matmul_flops(B, L, Q, K, D, S, tiling, matmuls=3))):  # QK^T, dO V^T, dS K
        dq = pl.pallas_call(
            functools.partial(_dq_kernel, block_k=bk, scale=scale),
            grid=(B, K, L // bq),
            in_specs=[pl.BlockSpec((None, None, 2), lambda b, h, n: (b, n, 0)), q_block, kv_whole, kv_whole,
                      q_block, stat_block, stat_block, *int_specs],
            out_specs=q_block, out_shape=output(q, q.shape, grad_dtype), name="flash_dq",
            **_params(tiling),
        )(query_block_ranges(q_doc_start, q_position, k_position, bq, bk), q, k, v, do, lse, delta, *ints)

    int_specs = [pl.BlockSpec((L,), lambda b, h, j: (0,)), pl.BlockSpec((None, L), lambda b, h, j: (b, 0)),
                 pl.BlockSpec((bk,), lambda b, h, j: (j,)), pl.BlockSpec((None, bk), lambda b, h, j: (b, j))]
    q_whole = pl.BlockSpec((None, L, Q, None, D), lambda b, h, j: (b, 0, 0, h, 0))
    stat_whole = pl.BlockSpec((None, L, Q, None), lambda b, h, j: (b, 0, 0, h))
    kv_block = pl.BlockSpec((None, bk, None, D), lambda b, h, j: (b, j, h, 0))
    with jax.named_scope(stated_flops(matmul_flops(B, L, Q, K, D, S, tiling, matmuls=4))):  # KQ^T, V dO^T, dV, dK
        dk, dv = pl.pallas_call(
            functools.partial(_dkv_kernel, block_q=bq, scale=scale),
            grid=(B, K, S // bk),
            in_specs=[pl.BlockSpec((None, None, 2), lambda b, h, j: (b, j, 0)), q_whole, q_whole, stat_whole,
                      stat_whole, kv_block, kv_block, *int_specs],
            out_specs=[kv_block, kv_block],
            out_shape=[output(k, k.shape, grad_dtype), output(v, v.shape, grad_dtype)],
            name="flash_dkv", **_params(tiling),
        )(key_block_ranges(q_doc_start, q_position, k_position, bq, bk), q, do, lse, delta, k, v, *ints)
    return dq, dk, dv
