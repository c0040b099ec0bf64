"""Flash attention for Hopper GPUs (compute capability 9.x): flash_blocks.py's algorithm as Pallas kernels for
the Mosaic GPU lowering, which programs a Hopper as it is: warpgroups of 128 threads, wgmma matrix products
from shared memory, TMA copies between global and shared memory, and barriers. On a CPU, in Mosaic GPU's
interpret mode, which simulates the shared memory, the warpgroups and their barriers.

Each kernel is a grid of programs, each program a producer warpgroup and one or more consumer warpgroups.
The producer walks the run of blocks its program visits (query_block_ranges / key_block_ranges: skipped
blocks are never loaded) and copies each block's operands into one of `num_stages` shared-memory slots,
`num_stages` blocks ahead of the consumers; a slot is refilled once every consumer has arrived at its
"consumed" barrier. So the next blocks load while the consumers multiply.

- forward (o, lse) and dq: one program per (row b, kv head h, query block n, group of query heads), one
  consumer per query head of the group: the Q query heads of a kv group share each key block the producer
  loads (grouped-query attention reads K and V once per group), and each head's 64 query rows are one wgmma
  tile. The group is as many heads as fit the shared memory (heads_per_program).
- dk and dv: one program per (b, h, key block j), one consumer that walks the query blocks and query heads
  visiting j and sums into one float32 dk and dv (no atomics: the program owns its output block).

What the kernels ask of the lowering is what its interpret mode runs (jax 0.10.2): both wgmma operands in
shared memory, untransposed. So the operands that a product needs transposed (K^T for Q K^T, V^T for
dO V^T, Q^T and dO^T for the transposed scores of dk and dv) are transposed in memory by XLA before the
kernels, and the softmax weights reach P V through shared memory rather than registers. FlashAttention-3's
transposes in shared memory, registers as the first operand and ping-pong scheduling of two consumers are
what a device would tune next (docs/flash-attention.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from seqax.analysis.roofline import stated_flops
from seqax.kernels.flash_blocks import (
    F32,
    Tiling,
    check_shapes,
    key_block_ranges,
    matmul_flops,
    output,
    query_block_ranges,
)
from seqax.shardlib.shardops import vary_as

BLOCK = 64  # query and key blocks: a wgmma tile's 64 rows; a row of 64 bf16 is one 128-byte swizzle
SHARED_MEMORY_BYTES = 232_448  # an H100's or H200's shared memory per program (227 KiB)
# bf16 tiles as wgmma reads them: 8 x 64 tiles, 128-byte swizzle
TILES = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
TILE = plgpu.Layout.WGMMA  # a wgmma accumulator's layout in registers
ROW, COLUMN = TILE.reduce(1), TILE.reduce(0)  # vectors along a tile's rows (one value a row), columns
RANGE = 32  # a run [first, stop) padded to 32 int32: a copy moves a multiple of 128 bytes
# Consumer warpgroups a program holds at most: the 65,536 registers of a Hopper's multiprocessor are shared by
# its threads, and with a producer and 5 consumers (768 threads: 85 a thread) ptxas cannot hold a forward
# step's tiles at D = 128 ("insufficient registers (80)", 2026-12-06); with 4 it compiles.
MAX_CONSUMERS = 4


def check_tiling(q, tiling: Tiling):
    """The shapes the kernels take: blocks of BLOCK and a head dimension of a multiple of 64 (wgmma tiles)."""
    D = q.shape[-1]
    if tiling.block_q != BLOCK or tiling.block_k != BLOCK or D % 64:
        raise ValueError(f"the Hopper kernels take blocks of {BLOCK} and a head dimension of a multiple of 64, "
                         f"got blocks {tiling.block_q} x {tiling.block_k} and D = {D}")


def heads_per_program(Q: int, per_head: int, per_stage: int, stages: int) -> int:
    """The most query heads of a group (a divisor of Q, at most MAX_CONSUMERS; at least 1) whose program fits
    the shared memory, given the bytes a head and a pipeline stage take."""
    fits = [h for h in range(1, min(Q, MAX_CONSUMERS) + 1)
            if Q % h == 0 and h * per_head + stages * per_stage + 4096 <= SHARED_MEMORY_BYTES]
    return max(fits, default=1)


def _laid_out(x, layout, interpret: bool):
    """x in registers laid out as `layout`: a tile as wgmma's accumulator (TILE), a block's positions or
    statistics [BLOCK] as a row or column of one. The GPU compiler needs the layout said; the interpreter has
    none to say (no layout_cast)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _product(a_ref, b_ref, shape):
    """a [m, k] @ b [k, n], both in shared memory, accumulated in float32 (wgmma)."""
    def run(acc):
        plgpu.wgmma(acc, a_ref, b_ref)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, F32))


def _store(ref, value):
    """value into shared memory, visible to wgmma and TMA after (all threads' writes fenced)."""
    ref[...] = value.astype(ref.dtype)
    plgpu.commit_smem()


def _write_out(stage_ref, value, out_ref):
    """value to global memory through its staging buffer in shared memory."""
    _store(stage_ref, value)
    plgpu.copy_smem_to_gmem(stage_ref, out_ref)
    plgpu.wait_smem_to_gmem(0)


def _load(copies, barriers, first: int | jax.Array = 0):
    """TMA copies (global ref, shared ref), the i-th signalling barriers[first + i] when it lands."""
    for i, (source, destination) in enumerate(copies):
        plgpu.copy_gmem_to_smem(source, destination, barriers.at[first + i])


def _wait(barriers, count: int, first: int | jax.Array = 0):
    for i in range(count):
        plgpu.barrier_wait(barriers.at[first + i])


def _stream(steps, stages: int, copies_of, ready, consumed):
    """The producer: step i's copies (copies_of(i, slot): n of them) into slot i % stages, once every consumer
    is done with what the slot held (step i - stages). Barriers: ready [stages x n], consumed [stages]."""
    @pl.loop(0, steps)
    def _(i):
        slot = lax.rem(i, stages)

        @pl.when(i >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        copies = copies_of(i, slot)
        _load(copies, ready, slot * len(copies))

    # and sees the last steps consumed too: the interpreter checks that a thread waiting on a barrier has
    # seen every phase of it by the end (on a device the wait costs an idle producer nothing)
    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(i):
        plgpu.barrier_wait(consumed.at[lax.rem(i, stages)])


def _forward_kernel(ranges_ref, q_ref, kt_ref, v_ref, q_pos_ref, q_doc_ref, k_pos_ref, k_doc_ref, o_ref, lse_ref,
                    run_s, q_pos_s, q_doc_s, q_s, p_s, lse_s, kt_s, v_s, k_pos_s, k_doc_s,
                    meta_ready, q_ready, ready, consumed, *o_s, heads, stages, scale, interpret):
    o_s = o_s[0] if o_s else q_s  # o leaves through q's buffer when it has q's dtype
    (b, h, n, g, wg), rows, first, steps = _query_block(heads, ranges_ref, q_pos_ref, q_doc_ref, run_s, q_pos_s,
                                                        q_doc_s, meta_ready)

    @pl.when(wg == heads)
    def _():
        def copies_of(i, slot):
            keys = pl.ds((first + i) * BLOCK, BLOCK)
            return [(kt_ref.at[b, h, :, keys], kt_s.at[slot]), (v_ref.at[b, keys, h, :], v_s.at[slot]),
                    (k_pos_ref.at[keys], k_pos_s.at[slot]), (k_doc_ref.at[b, keys], k_doc_s.at[slot])]
        _stream(steps, stages, copies_of, ready, consumed)

    @pl.when(wg < heads)
    def _():
        i = jnp.minimum(wg, heads - 1)  # this warpgroup's head in the group
        head = g * heads + i
        _load([(q_ref.at[b, rows, head, h, :], q_s.at[i])], q_ready, i)
        plgpu.barrier_wait(q_ready.at[i])
        query = _query_side(q_pos_s, q_doc_s, interpret)

        def add_key_block(step, carry):  # flash_blocks.softmax_step, a row's statistics as a vector
            m, l, acc = carry
            slot = lax.rem(step, stages)
            _wait(ready, 4, slot * 4)
            s = _product(q_s.at[i], kt_s.at[slot], (BLOCK, BLOCK))
            s = jnp.where(_visible(query, k_pos_s.at[slot], k_doc_s.at[slot], interpret), s * scale, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - _rows(m_safe, s.shape))
            rescale = jnp.exp(m - m_safe)
            _store(p_s.at[i], p)
            acc = acc * _rows(rescale, acc.shape) + _product(p_s.at[i], v_s.at[slot], acc.shape)
            plgpu.barrier_arrive(consumed.at[slot])
            return m_new, rescale * l + p.sum(axis=1), acc

        D = q_s.shape[-1]
        init = (_laid_out(jnp.full((BLOCK,), -jnp.inf, F32), ROW, interpret),
                _laid_out(jnp.zeros((BLOCK,), F32), ROW, interpret),
                _laid_out(jnp.zeros((BLOCK, D), F32), TILE, interpret))
        m, l, acc = lax.fori_loop(0, steps, add_key_block, init)
        seen = l > 0.0  # flash_blocks.softmax_finish
        l_safe = jnp.where(seen, l, 1.0)
        _store(lse_s.at[i], jnp.where(seen, m + jnp.log(l_safe), -jnp.inf))
        plgpu.copy_smem_to_gmem(lse_s.at[i], lse_ref.at[b, h, head, rows])
        _write_out(o_s.at[i], acc / _rows(l_safe, acc.shape), o_ref.at[b, rows, head, h, :])


def _dq_kernel(ranges_ref, q_ref, do_ref, lse_ref, delta_ref, kt_ref, vt_ref, k_ref, q_pos_ref, q_doc_ref, k_pos_ref,
               k_doc_ref, dq_ref, run_s, q_pos_s, q_doc_s, q_s, do_s, lse_s, delta_s, ds_s, kt_s, vt_s, k_s, k_pos_s,
               k_doc_s, meta_ready, q_ready, ready, consumed, *dq_s, heads, stages, scale, interpret):
    """dq of one query block of a group of heads over the forward pass's run of key blocks (flash_blocks.dq_step)."""
    dq_s = dq_s[0] if dq_s else q_s
    (b, h, n, g, wg), rows, first, steps = _query_block(heads, ranges_ref, q_pos_ref, q_doc_ref, run_s, q_pos_s,
                                                        q_doc_s, meta_ready)

    @pl.when(wg == heads)
    def _():
        def copies_of(i, slot):
            keys = pl.ds((first + i) * BLOCK, BLOCK)
            return [(kt_ref.at[b, h, :, keys], kt_s.at[slot]), (vt_ref.at[b, h, :, keys], vt_s.at[slot]),
                    (k_ref.at[b, keys, h, :], k_s.at[slot]), (k_pos_ref.at[keys], k_pos_s.at[slot]),
                    (k_doc_ref.at[b, keys], k_doc_s.at[slot])]
        _stream(steps, stages, copies_of, ready, consumed)

    @pl.when(wg < heads)
    def _():
        i = jnp.minimum(wg, heads - 1)
        head = g * heads + i
        _load([(q_ref.at[b, rows, head, h, :], q_s.at[i]), (do_ref.at[b, rows, head, h, :], do_s.at[i]),
               (lse_ref.at[b, h, head, rows], lse_s.at[i]), (delta_ref.at[b, h, head, rows], delta_s.at[i])],
              q_ready, 4 * i)
        _wait(q_ready, 4, 4 * i)
        query = _query_side(q_pos_s, q_doc_s, interpret)
        lse = _by_row(lse_s.at[i], interpret)
        delta = _by_row(delta_s.at[i], interpret)

        def add_key_block(step, dq):
            slot = lax.rem(step, stages)
            _wait(ready, 5, slot * 5)
            s = _product(q_s.at[i], kt_s.at[slot], (BLOCK, BLOCK))
            visible = _visible(query, k_pos_s.at[slot], k_doc_s.at[slot], interpret)
            p = jnp.exp(jnp.where(visible, s * scale - lse, -jnp.inf))
            _store(ds_s.at[i], p * (_product(do_s.at[i], vt_s.at[slot], (BLOCK, BLOCK)) - delta))
            dq = dq + _product(ds_s.at[i], k_s.at[slot], dq.shape)
            plgpu.barrier_arrive(consumed.at[slot])
            return dq

        dq = lax.fori_loop(0, steps, add_key_block, _laid_out(jnp.zeros(q_s.shape[1:], F32), TILE, interpret))
        _write_out(dq_s.at[i], dq * scale, dq_ref.at[b, rows, head, h, :])


def _dkv_kernel(ranges_ref, qt_ref, q_ref, do_ref, dot_ref, lse_ref, delta_ref, k_ref, v_ref, q_pos_ref, q_doc_ref,
                k_pos_ref, k_doc_ref, dk_ref, dv_ref, run_s, k_pos_s, k_doc_s, k_s, v_s, p_s, ds_s, qt_s, q_s, do_s,
                dot_s, lse_s, delta_s, q_pos_s, q_doc_s, meta_ready, ready, consumed, *out_s, heads, stages, scale,
                interpret):
    """dk and dv of one key block over the run of query blocks that visit it and each one's Q query heads
    (flash_blocks.dkv_step: transposed, keys as rows), into one float32 dk and dv."""
    b, h, j, wg = (lax.axis_index(a) for a in ("b", "h", "j", "wg"))
    keys = pl.ds(j * BLOCK, BLOCK)
    first, steps = _run(wg == 1, [(ranges_ref.at[b, j], run_s), (k_pos_ref.at[keys], k_pos_s),
                                  (k_doc_ref.at[b, keys], k_doc_s), (k_ref.at[b, keys, h, :], k_s),
                                  (v_ref.at[b, keys, h, :], v_s)], run_s, meta_ready)
    steps = steps * heads  # step i: query block first + i // heads, head i % heads

    @pl.when(wg == 1)
    def _():
        def copies_of(i, slot):
            rows, head = pl.ds((first + i // heads) * BLOCK, BLOCK), lax.rem(i, heads)
            return [(qt_ref.at[b, head, h, :, rows], qt_s.at[slot]), (q_ref.at[b, rows, head, h, :], q_s.at[slot]),
                    (do_ref.at[b, rows, head, h, :], do_s.at[slot]), (dot_ref.at[b, head, h, :, rows], dot_s.at[slot]),
                    (lse_ref.at[b, h, head, rows], lse_s.at[slot]), (delta_ref.at[b, h, head, rows], delta_s.at[slot]),
                    (q_pos_ref.at[rows], q_pos_s.at[slot]), (q_doc_ref.at[b, rows], q_doc_s.at[slot])]
        _stream(steps, stages, copies_of, ready, consumed)

    @pl.when(wg == 0)
    def _():
        k_position = _by_row(k_pos_s, interpret)
        k_doc_start = _by_row(k_doc_s, interpret)

        def add_query_block(step, carry):
            dk, dv = carry
            slot = lax.rem(step, stages)
            _wait(ready, 8, slot * 8)
            visible = ((k_position <= _by_column(q_pos_s.at[slot], interpret))
                       & (k_doc_start == _by_column(q_doc_s.at[slot], interpret)))
            s_t = _product(k_s, qt_s.at[slot], (BLOCK, BLOCK))
            p_t = jnp.exp(jnp.where(visible, s_t * scale - _by_column(lse_s.at[slot], interpret),
                                    -jnp.inf))
            _store(p_s, p_t)
            dv = dv + _product(p_s, do_s.at[slot], dv.shape)
            dp_t = _product(v_s, dot_s.at[slot], (BLOCK, BLOCK))
            _store(ds_s, p_t * (dp_t - _by_column(delta_s.at[slot], interpret)))
            dk = dk + _product(ds_s, q_s.at[slot], dk.shape)
            plgpu.barrier_arrive(consumed.at[slot])
            return dk, dv

        zeros = _laid_out(jnp.zeros(k_s.shape, F32), TILE, interpret)
        dk, dv = lax.fori_loop(0, steps, add_query_block, (zeros, zeros))
        dk_s, dv_s = (out_s[0], out_s[0]) if out_s else (k_s, v_s)  # k's and v's buffers when they have their dtype
        _write_out(dk_s, dk * scale, dk_ref.at[b, keys, h, :])
        _write_out(dv_s, dv, dv_ref.at[b, keys, h, :])


def _run(is_producer, copies, run_s, barriers):
    """The program's first block and block count, from its run (the first of `copies`, which the producer
    makes and every warpgroup waits for)."""
    @pl.when(is_producer)
    def _():
        _load(copies, barriers)

    _wait(barriers, len(copies))
    return run_s[0], run_s[1] - run_s[0]


def _query_block(heads, ranges_ref, q_pos_ref, q_doc_ref, run_s, q_pos_s, q_doc_s, barriers):
    """What the forward's and dq's programs start with: their grid and thread indices (b, h, n, g, wg), their
    query block's rows, and its run of key blocks (first, count), with the block's positions and doc starts
    copied in by the producer (warpgroup `heads`)."""
    b, h, n, g, wg = (lax.axis_index(a) for a in ("b", "h", "n", "g", "wg"))
    rows = pl.ds(n * BLOCK, BLOCK)
    first, steps = _run(wg == heads, [(ranges_ref.at[b, n], run_s), (q_pos_ref.at[rows], q_pos_s),
                                      (q_doc_ref.at[b, rows], q_doc_s)], run_s, barriers)
    return (b, h, n, g, wg), rows, first, steps


def _query_side(q_pos_s, q_doc_s, interpret):
    return tuple(_by_row(ref, interpret) for ref in (q_pos_s, q_doc_s))


def _visible(query, k_pos_s, k_doc_s, interpret):
    """flash_blocks.visible: queries as rows, keys as columns of a [BLOCK, BLOCK] tile."""
    q_position, q_doc_start = query
    k_position, k_doc_start = _by_column(k_pos_s, interpret), _by_column(k_doc_s, interpret)
    return (k_position <= q_position) & (k_doc_start == q_doc_start)


def _by_row(ref, interpret):
    """A block's vector [BLOCK] in shared memory, one value a row of a [BLOCK, BLOCK] tile."""
    return _rows(_laid_out(ref[...], ROW, interpret), (BLOCK, BLOCK))


def _by_column(ref, interpret):
    """A block's vector [BLOCK] in shared memory, one value a column of a [BLOCK, BLOCK] tile."""
    return _columns(_laid_out(ref[...], COLUMN, interpret), (BLOCK, BLOCK))


def _rows(vector, shape):
    """A vector along a tile's rows (one value a row), broadcast to the tile."""
    return lax.broadcast_in_dim(vector, shape, [0])


def _columns(vector, shape):
    return lax.broadcast_in_dim(vector, shape, [1])


def _smem(shape, dtype, tiled: bool = False):
    return plgpu.SMEM(shape, dtype, transforms=TILES if tiled else ())


def _barriers(count: int, arrivals: int = 1):
    return plgpu.Barrier(num_arrivals=arrivals, num_barriers=count)


def _interpret(tiling: Tiling):
    # jax 0.10.2 exports the Mosaic GPU interpreter's parameters under no public name (only in jax._src)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams() if tiling.interpret else False


def _padded(ranges):
    return jnp.pad(ranges, ((0, 0), (0, 0), (0, RANGE - 2)))


def _by_length(x):
    """[B, L, Q, K] statistics as [B, K, Q, L]: a query block's are then contiguous, as a copy needs."""
    return jnp.transpose(x, (0, 3, 2, 1))


def _staging(out_dtype, like, shape):
    """The scratch a kernel stages an output in, when the buffer it reuses (like's dtype) will not do."""
    return [] if jnp.dtype(out_dtype) == jnp.dtype(like) else [_smem(shape, out_dtype)]


def _call(kernel, out_type, grid, grid_names, threads, scratch, tiling, flops, *args):
    with jax.named_scope(stated_flops(flops)):
        results = plgpu.kernel(kernel, out_type=out_type, grid=grid, grid_names=grid_names, num_threads=threads,
                               thread_name="wg", scratch_types=scratch, interpret=_interpret(tiling))(*args)
    # typed as varying over the mesh axes the inputs vary over (inside a shard_map that checks them):
    # plgpu.kernel does not carry out_type's manual axes through, as pallas_call does
    return jax.tree.map(lambda x: vary_as(x, *args), results)


def forward(q, k, v, q_doc_start, k_doc_start, q_position, k_position, tiling: Tiling, o_dtype):
    """(o [B, L, Q, K, D] in o_dtype, lse [B, L, Q, K] float32) of q over k, v [B, S, K, D]; doc starts
    [B, L] and [B, S], positions [L] and [S], int32: flash_gpu.forward's contract."""
    B, L, Q, K, D, S = check_shapes(q, k, tiling)
    check_tiling(q, tiling)
    stages, bf, i32 = tiling.num_stages, q.dtype, jnp.int32
    staging = _staging(o_dtype, bf, (BLOCK, D))
    per_head = BLOCK * D * 2 + BLOCK * BLOCK * 2 + BLOCK * 4 + sum(BLOCK * D * jnp.dtype(o_dtype).itemsize
                                                                    for _ in staging)
    heads = heads_per_program(Q, per_head, 2 * D * BLOCK * 2 + 2 * BLOCK * 4, stages)
    scratch = [_smem((RANGE,), i32), _smem((BLOCK,), i32), _smem((BLOCK,), i32), _smem((heads, BLOCK, D), bf, True),
               _smem((heads, BLOCK, BLOCK), bf, True), _smem((heads, BLOCK), F32), _smem((stages, D, BLOCK), bf, True),
               _smem((stages, BLOCK, D), bf, True), _smem((stages, BLOCK), i32), _smem((stages, BLOCK), i32),
               _barriers(3), _barriers(heads), _barriers(stages * 4), _barriers(stages, heads),
               *(_smem((heads, BLOCK, D), o_dtype) for _ in staging)]
    kernel = functools.partial(_forward_kernel, heads=heads, stages=stages, scale=D**-0.5, interpret=tiling.interpret)
    o, lse = _call(kernel, (output(q, q.shape, o_dtype), output(q, (B, K, Q, L), F32)),
                   (B, K, L // BLOCK, Q // heads), ("b", "h", "n", "g"), heads + 1, scratch, tiling,
                   matmul_flops(B, L, Q, K, D, S, tiling, matmuls=2),  # QK^T, PV
                   _padded(query_block_ranges(q_doc_start, q_position, k_position, BLOCK, BLOCK)), q,
                   jnp.transpose(k, (0, 2, 3, 1)), v, q_position, q_doc_start, k_position, k_doc_start)
    return o, _by_length(lse)


def backward(q, k, v, do, lse, delta, q_doc_start, k_doc_start, q_position, k_position, tiling: Tiling, grad_dtype):
    """(dq, dk, dv) in grad_dtype, by two kernels: dq over key blocks, dk and dv over query blocks; lse and delta
    [B, L, Q, K] float32: flash_gpu.backward's contract."""
    B, L, Q, K, D, S = check_shapes(q, k, tiling)
    check_tiling(q, tiling)
    stages, bf, i32, scale = tiling.num_stages, q.dtype, jnp.int32, D**-0.5
    lse, delta = _by_length(lse), _by_length(delta)
    ints = (q_position, q_doc_start, k_position, k_doc_start)

    staging = _staging(grad_dtype, bf, (BLOCK, D))
    per_head = 2 * BLOCK * D * 2 + 2 * BLOCK * 4 + BLOCK * BLOCK * 2 + sum(BLOCK * D * 4 for _ in staging)
    heads = heads_per_program(Q, per_head, 3 * D * BLOCK * 2 + 2 * BLOCK * 4, stages)
    scratch = [_smem((RANGE,), i32), _smem((BLOCK,), i32), _smem((BLOCK,), i32), _smem((heads, BLOCK, D), bf, True),
               _smem((heads, BLOCK, D), bf, True), _smem((heads, BLOCK), F32), _smem((heads, BLOCK), F32),
               _smem((heads, BLOCK, BLOCK), bf, True), _smem((stages, D, BLOCK), bf, True),
               _smem((stages, D, BLOCK), bf, True), _smem((stages, BLOCK, D), bf, True), _smem((stages, BLOCK), i32),
               _smem((stages, BLOCK), i32), _barriers(3), _barriers(4 * heads), _barriers(stages * 5),
               _barriers(stages, heads), *(_smem((heads, BLOCK, D), grad_dtype) for _ in staging)]
    kernel = functools.partial(_dq_kernel, heads=heads, stages=stages, scale=scale, interpret=tiling.interpret)
    kt, vt = (jnp.transpose(x, (0, 2, 3, 1)) for x in (k, v))  # [B, K, D, S]
    dq = _call(kernel, output(q, q.shape, grad_dtype), (B, K, L // BLOCK, Q // heads),
               ("b", "h", "n", "g"), heads + 1, scratch, tiling,
               matmul_flops(B, L, Q, K, D, S, tiling, matmuls=3),  # QK^T, dO V^T, dS K
               _padded(query_block_ranges(q_doc_start, q_position, k_position, BLOCK, BLOCK)), q, do, lse, delta,
               kt, vt, k, *ints)

    vectors = [_smem((stages, BLOCK), t) for t in (F32, F32, i32, i32)]  # lse, delta, positions, doc starts
    scratch = [_smem((RANGE,), i32), _smem((BLOCK,), i32), _smem((BLOCK,), i32), _smem((BLOCK, D), bf, True),
               _smem((BLOCK, D), bf, True), _smem((BLOCK, BLOCK), bf, True), _smem((BLOCK, BLOCK), bf, True),
               _smem((stages, D, BLOCK), bf, True), _smem((stages, BLOCK, D), bf, True),
               _smem((stages, BLOCK, D), bf, True), _smem((stages, D, BLOCK), bf, True), *vectors,
               _barriers(5), _barriers(stages * 8), _barriers(stages), *_staging(grad_dtype, bf, (BLOCK, D))]
    kernel = functools.partial(_dkv_kernel, heads=Q, stages=stages, scale=scale, interpret=tiling.interpret)
    qt, dot = (jnp.transpose(x, (0, 2, 3, 4, 1)) for x in (q, do))  # [B, Q, K, D, L]
    out = output(k, k.shape, grad_dtype)
    dk, dv = _call(kernel, (out, out), (B, K, S // BLOCK), ("b", "h", "j"), 2, scratch, tiling,
                   matmul_flops(B, L, Q, K, D, S, tiling, matmuls=4),  # KQ^T, V dO^T, dV, dK
                   _padded(key_block_ranges(q_doc_start, q_position, k_position, BLOCK, BLOCK)), qt, q, do, dot,
                   lse, delta, k, v, *ints)
    return dq, dk, dv
