"""Flash attention for TPUs: flash_blocks.py's algorithm as Pallas kernels for the Mosaic lowering
(interpret mode, plain or simulating the TPU, on a CPU). Same block pairs and the same arithmetic
per pair as flash_gpu.py; what differs is what Mosaic requires:

- The reduction over blocks is the last grid axis ("arbitrary": its steps run in order on one
  core), the running statistics in VMEM scratch, set up at its first step and written out at its
  last. Step t visits block first + t of the run. The run bounds are scalar-prefetch operands
  (SMEM) that the index maps read too, so the pipeline copies in only the visited blocks: past the
  run's end the index map repeats the run's last block, which the pipeline does not copy again,
  and pl.when skips the arithmetic. (A loop inside the kernel, as on a GPU, would need all of a
  head's keys and values in VMEM, or hand-written copies.)
- A block's last two dimensions must be multiples of (8, 128) or whole, and a squeezed dimension
  cannot be second to last: so q, k, v go head-major ([B, K, Q, L, D], [B, K, S, D], one transpose
  each in XLA, as attention.to_head_blocks does), a block of Q heads is [Q, block_q, D], lse and
  delta are [B, K, Q, L] (rows: lane-dense), positions [1, L] and doc starts [B, 1, L]. A row
  [1, block_q] becomes the column that the forward and dq steps need by a reshape.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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


def _run_block(t, first, stop, last_block: int):
    """The block at step t of the run [first, stop): past its end the run's last block again (no
    new copy), clipped so that an empty run still names a real block (never used: pl.when)."""
    return jnp.clip(jnp.minimum(first + t, stop - 1), 0, last_block)


def _forward_kernel(first_ref, stop_ref, q_ref, k_ref, v_ref, q_pos_ref, q_doc_ref, k_pos_ref, k_doc_ref, o_ref,
                    lse_ref, m_scr, l_scr, acc_scr, *, scale: float):
    b, n, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    heads, block_q, head_dim = q_ref.shape
    run = b * pl.num_programs(2) + n

    @pl.when(t == 0)
    def _():
        for h in range(heads):
            m_scr[h], l_scr[h], acc_scr[h] = softmax_init(block_q, head_dim)

    @pl.when(t < stop_ref[run] - first_ref[run])
    def _():
        k, v = k_ref[...], v_ref[...]  # read once for all heads of the group
        mask = visible(q_pos_ref[...].reshape(block_q, 1), q_doc_ref[...].reshape(block_q, 1), k_pos_ref[...],
                       k_doc_ref[...])
        for h in range(heads):
            m_scr[h], l_scr[h], acc_scr[h] = softmax_step((m_scr[h], l_scr[h], acc_scr[h]), q_ref[h], k, v, mask,
                                                          scale)

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        for h in range(heads):
            o, lse = softmax_finish((m_scr[h], l_scr[h], acc_scr[h]))
            o_ref[h] = o.astype(o_ref.dtype)
            lse_ref[h] = lse.reshape(block_q)


def _dq_kernel(first_ref, stop_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, q_doc_ref, k_pos_ref,
               k_doc_ref, dq_ref, dq_scr, *, scale: float):
    b, n, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    heads, block_q, head_dim = q_ref.shape
    run = b * pl.num_programs(2) + n

    @pl.when(t == 0)
    def _():
        dq_scr[...] = jnp.zeros(dq_scr.shape, F32)

    @pl.when(t < stop_ref[run] - first_ref[run])
    def _():
        k, v = k_ref[...], v_ref[...]
        mask = visible(q_pos_ref[...].reshape(block_q, 1), q_doc_ref[...].reshape(block_q, 1), k_pos_ref[...],
                       k_doc_ref[...])
        for h in range(heads):
            dq_scr[h] = dq_step(dq_scr[h], q_ref[h], do_ref[h], lse_ref[h].reshape(block_q, 1),
                                delta_ref[h].reshape(block_q, 1), k, v, mask, scale)

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = (dq_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(first_ref, stop_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, q_pos_ref, q_doc_ref, k_pos_ref,
                k_doc_ref, dk_ref, dv_ref, dk_scr, dv_scr, *, scale: float):
    b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    heads = q_ref.shape[0]
    block_k = k_ref.shape[0]
    run = b * pl.num_programs(2) + j

    @pl.when(t == 0)
    def _():
        dk_scr[...] = jnp.zeros(dk_scr.shape, F32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, F32)

    @pl.when(t < stop_ref[run] - first_ref[run])
    def _():
        k, v = k_ref[...], v_ref[...]
        mask_t = visible(q_pos_ref[...], q_doc_ref[...], k_pos_ref[...].reshape(block_k, 1),
                         k_doc_ref[...].reshape(block_k, 1))
        dk_dv = dk_scr[...], dv_scr[...]
        for h in range(heads):  # the Q heads of the group add into one dk, dv
            dk_dv = dkv_step(*dk_dv, k, v, q_ref[h], do_ref[h], lse_ref[pl.ds(h, 1), :], delta_ref[pl.ds(h, 1), :],
                             mask_t, scale)
        dk_scr[...], dv_scr[...] = dk_dv

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _head_major(q, *kv):
    """q [B, L, Q, K, D] -> [B, K, Q, L, D]; each of kv [B, S, K, D] -> [B, K, S, D]. Each
    permutation is its own inverse: the same call takes the kernels' outputs back."""
    return (jnp.transpose(q, (0, 3, 2, 1, 4)), *(jnp.transpose(x, (0, 2, 1, 3)) for x in kv))


def _ints(q_doc_start, k_doc_start, q_position, k_position):
    """Positions [1, L], doc starts [B, 1, L]: their blocks (1, block) then have legal last two dimensions."""
    return q_position[None, :], q_doc_start[:, None, :], k_position[None, :], k_doc_start[:, None, :]


def _runs(ranges):
    """[B, X, 2] ranges -> flat first, stop [B * X] for SMEM (1-D: a 2-D SMEM array pads to (8, 128) words)."""
    return ranges[..., 0].reshape(-1), ranges[..., 1].reshape(-1)


def _params(tiling: Tiling) -> dict:
    interpret = (pltpu.InterpretParams() if tiling.simulate_tpu else True) if tiling.interpret else False
    return dict(compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")), interpret=interpret)


def _int_specs(query, key, bq: int, bk: int) -> list:
    """BlockSpecs of q's positions and doc starts, then k's, whose block indices the functions
    query(b, x, t, *runs) and key(b, x, t, *runs) give."""
    return [pl.BlockSpec((1, bq), lambda b, h, x, t, *r: (0, query(b, x, t, *r))),
            pl.BlockSpec((None, 1, bq), lambda b, h, x, t, *r: (b, 0, query(b, x, t, *r))),
            pl.BlockSpec((1, bk), lambda b, h, x, t, *r: (0, key(b, x, t, *r))),
            pl.BlockSpec((None, 1, bk), lambda b, h, x, t, *r: (b, 0, key(b, x, t, *r)))]


def forward(q, k, v, q_doc_start, k_doc_start, q_position, k_position, tiling: Tiling, o_dtype):
    """(o [B, L, Q, K, D] in o_dtype, lse [B, L, Q, K] float32): flash_gpu.forward's interface."""
    B, L, Q, K, D, S = check_shapes(q, k, tiling)
    bq, bk = tiling.block_q, tiling.block_k
    N, M = L // bq, S // bk
    first, stop = _runs(query_block_ranges(q_doc_start, q_position, k_position, bq, bk))
    key = lambda b, n, t, first, stop: _run_block(t, first[b * N + n], stop[b * N + n], M - 1)  # noqa: E731
    query = lambda b, n, t, *_: n  # noqa: E731
    q_spec = pl.BlockSpec((None, None, Q, bq, D), lambda b, h, n, t, *_: (b, h, 0, n, 0))
    kv_spec = pl.BlockSpec((None, None, bk, D), lambda b, h, n, t, *r: (b, h, key(b, n, t, *r), 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, K, N, M),  # M: the longest run a query block can have
        in_specs=[q_spec, kv_spec, kv_spec, *_int_specs(query, key, bq, bk)],
        out_specs=[q_spec, pl.BlockSpec((None, None, Q, bq), lambda b, h, n, t, *_: (b, h, 0, n))],
        scratch_shapes=[pltpu.VMEM((Q, bq, 1), F32), pltpu.VMEM((Q, bq, 1), F32), pltpu.VMEM((Q, bq, D), F32)])
    qh, kh, vh = _head_major(q, k, v)
    with jax.named_scope(stated_flops(matmul_flops(B, L, Q, K, D, S, tiling, matmuls=2))):  # QK^T, PV
        o, lse = pl.pallas_call(
            functools.partial(_forward_kernel, scale=D**-0.5), grid_spec=grid_spec,
            out_shape=[output(q, qh.shape, o_dtype), output(q, (B, K, Q, L), F32)],
            name="flash_forward", **_params(tiling),
        )(first, stop, qh, kh, vh, *_ints(q_doc_start, k_doc_start, q_position, k_position))
    return _head_major(o)[0], jnp.transpose(lse, (0, 3, 2, 1))


def backward(q, k, v, do, lse, delta, q_doc_start, k_doc_start, q_position, k_position, tiling: Tiling, grad_dtype):
    """(dq, dk, dv) in grad_dtype by two kernels: flash_gpu.backward's interface."""
    B, L, Q, K, D, S = check_shapes(q, k, tiling)
    bq, bk = tiling.block_q, tiling.block_k
    N, M = L // bq, S // bk
    scale = D**-0.5
    qh, kh, vh = _head_major(q, k, v)
    doh = _head_major(do)[0]
    lse_h, delta_h = jnp.transpose(lse, (0, 3, 2, 1)), jnp.transpose(delta, (0, 3, 2, 1))  # [B, K, Q, L]
    ints = _ints(q_doc_start, k_doc_start, q_position, k_position)

    first, stop = _runs(query_block_ranges(q_doc_start, q_position, k_position, bq, bk))
    key = lambda b, n, t, first, stop: _run_block(t, first[b * N + n], stop[b * N + n], M - 1)  # noqa: E731
    query = lambda b, n, t, *_: n  # noqa: E731
    q_block = pl.BlockSpec((None, None, Q, bq, D), lambda b, h, n, t, *_: (b, h, 0, n, 0))
    stat_block = pl.BlockSpec((None, None, Q, bq), lambda b, h, n, t, *_: (b, h, 0, n))
    kv_run = pl.BlockSpec((None, None, bk, D), lambda b, h, n, t, *r: (b, h, key(b, n, t, *r), 0))
    with jax.named_scope(stated_flops(matmul_flops(B, L, Q, K, D, S, tiling, matmuls=3))):  # QK^T, dO V^T, dS K
        dq = pl.pallas_call(
            functools.partial(_dq_kernel, scale=scale),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(B, K, N, M),
                in_specs=[q_block, kv_run, kv_run, q_block, stat_block, stat_block,
                          *_int_specs(query, key, bq, bk)],
                out_specs=q_block, scratch_shapes=[pltpu.VMEM((Q, bq, D), F32)]),
            out_shape=output(q, qh.shape, grad_dtype), name="flash_dq", **_params(tiling),
        )(first, stop, qh, kh, vh, doh, lse_h, delta_h, *ints)

    first, stop = _runs(key_block_ranges(q_doc_start, q_position, k_position, bq, bk))
    query = lambda b, j, t, first, stop: _run_block(t, first[b * M + j], stop[b * M + j], N - 1)  # noqa: E731
    key = lambda b, j, t, *_: j  # noqa: E731
    q_run = pl.BlockSpec((None, None, Q, bq, D), lambda b, h, j, t, *r: (b, h, 0, query(b, j, t, *r), 0))
    stat_run = pl.BlockSpec((None, None, Q, bq), lambda b, h, j, t, *r: (b, h, 0, query(b, j, t, *r)))
    kv_block = pl.BlockSpec((None, None, bk, D), lambda b, h, j, t, *_: (b, h, j, 0))
    with jax.named_scope(stated_flops(matmul_flops(B, L, Q, K, D, S, tiling, matmuls=4))):  # KQ^T, V dO^T, dV, dK
        dkh, dvh = pl.pallas_call(
            functools.partial(_dkv_kernel, scale=scale),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(B, K, M, N),  # N: the longest run of query blocks visiting a key block
                in_specs=[q_run, q_run, stat_run, stat_run, kv_block, kv_block, *_int_specs(query, key, bq, bk)],
                out_specs=[kv_block, kv_block],
                scratch_shapes=[pltpu.VMEM((bk, D), F32), pltpu.VMEM((bk, D), F32)]),
            out_shape=[output(k, kh.shape, grad_dtype), output(v, vh.shape, grad_dtype)],
            name="flash_dkv", **_params(tiling),
        )(first, stop, qh, doh, lse_h, delta_h, kh, vh, *ints)
    return _head_major(dq, dkh, dvh)
