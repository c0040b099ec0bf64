"""Flash attention's algorithm, shared by its two Pallas lowerings (flash_gpu.py for Triton,
flash_tpu.py for Mosaic): which (query block, key block) pairs a kernel visits, and the arithmetic
of one pair. flash_attention.py runs them around the context-parallel ring.

The kernels compute what attention.dense_attention with causal_document_mask computes: a query at
row position p_q in the document starting at s_q sees a key at p_k in the document starting at s_k
iff p_k <= p_q and s_q == s_k. Positions and document starts are inputs (with context parallelism a
device holds two chunks of each row, and in a ring step the keys are another device's), so they
must be: positions ascending within the queries and within the keys (a row in order, or a device's
two chunks); doc starts the row positions where documents start (train.document_positions), since
skipping compares them with key positions. Every (o, lse) a kernel returns is exact for the keys
it was given, so that results over different key shards merge exactly through the log-sum-exp.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a kernel cuts its work, and where it runs. Block sizes divide the query and key lengths;
    for a real target, powers of 2 (GPU: Triton's tensor shapes) or multiples of 128 or the whole
    length (TPU: a block's last dimension is its lanes); flash_attention.tiling_for chooses them."""

    lowering: str  # "gpu" (Triton), "hopper" (Mosaic GPU) or "tpu" (Mosaic TPU)
    block_q: int
    block_k: int
    interpret: bool = False  # on a CPU, by Pallas's interpret mode (the Hopper kernels: Mosaic GPU's)
    # The TPU kernels on a CPU: in the TPU interpret mode (pltpu.InterpretParams: scratch memory
    # starts as NaN, the pipeline's copies are simulated; slow) rather than plain interpret mode.
    simulate_tpu: bool = False
    num_warps: int = 4  # Triton only
    num_stages: int = 2  # GPU only: Triton's pipeline stages; the Hopper kernels' shared-memory slots


def check_shapes(q, k, tiling: Tiling) -> tuple[int, ...]:
    """(B, L, Q, K, D, S) of q [B, L, Q, K, D] and k [B, S, K, D], whose lengths must be whole blocks."""
    B, L, Q, K, D = q.shape
    S = k.shape[1]
    if L % tiling.block_q or S % tiling.block_k:
        raise ValueError(f"L={L} and S={S} must be multiples of block_q={tiling.block_q} and "
                         f"block_k={tiling.block_k}")
    return B, L, Q, K, D, S


def output(like, shape, dtype) -> jax.ShapeDtypeStruct:
    """A kernel's output of `shape` and `dtype`, varying over the mesh axes that the input `like`
    varies over: inside shard_map, pallas_call cannot work that out for itself."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


# ---------------------------------------------------------------------------------------------
# Which block pairs to visit. For query block n, a contiguous run [first, stop) of key blocks;
# the rest are never loaded or computed. A key block is skipped when all its keys lie after the
# query block's last query (the future), or all lie before the earliest document start among the
# block's queries (every query of the block is in a later document). Key positions ascend, so the
# blocks failing either test are a prefix and a suffix. Doc starts differ per row, so the runs are
# per (row b, block): tighter than attention.key_blocks_to_visit's one run for the whole batch.
# The backward pass also needs the transpose: for key block j, the run of query blocks that visit
# it (the same two tests solved for n, both monotone in n for the same reason).


def _block_bounds(q_doc_start, q_position, k_position, block_q: int, block_k: int):
    """Per query block its last position [N] and earliest document start [B, N]; per key block
    its first and last positions [M]. Minima and maxima, so nothing assumes order within a block."""
    B, L = q_doc_start.shape
    q_last = q_position.reshape(L // block_q, block_q).max(axis=1)
    q_earliest = q_doc_start.reshape(B, L // block_q, block_q).min(axis=2)
    k_blocks = k_position.reshape(-1, block_k)
    return q_last, q_earliest, k_blocks.min(axis=1), k_blocks.max(axis=1)


def query_block_ranges(q_doc_start, q_position, k_position, block_q: int, block_k: int):
    """[B, N, 2] int32: for query block n of row b, the key blocks [first, stop) that it visits."""
    q_last, q_earliest, k_first, k_last = _block_bounds(q_doc_start, q_position, k_position, block_q, block_k)
    first = jnp.sum(k_last[None, None, :] < q_earliest[:, :, None], axis=2)  # wholly before every document
    stop = jnp.sum(k_first[None, None, :] <= q_last[None, :, None], axis=2)  # not wholly in the future
    stop = jnp.maximum(stop, first)  # nothing to visit: an empty run
    return jnp.stack([first, stop], axis=-1).astype(jnp.int32)


def key_block_ranges(q_doc_start, q_position, k_position, block_q: int, block_k: int):
    """[B, M, 2] int32: for key block j of row b, the query blocks [first, stop) that visit it
    (query_block_ranges transposed: n visits j iff q_last[n] >= k_first[j] and q_earliest[n] <= k_last[j])."""
    q_last, q_earliest, k_first, k_last = _block_bounds(q_doc_start, q_position, k_position, block_q, block_k)
    first = jnp.sum(q_last[None, None, :] < k_first[None, :, None], axis=2)
    stop = jnp.sum(q_earliest[:, None, :] <= k_last[None, :, None], axis=2)
    stop = jnp.maximum(stop, first)
    first = jnp.broadcast_to(first, stop.shape)
    return jnp.stack([first, stop], axis=-1).astype(jnp.int32)


def causal_pairs(N: int, M: int) -> float:
    """Block pairs a kernel visits when its queries and keys cover the same positions of one
    document (N = M): those on and below the diagonal. What the kernels state as their work (the
    roofline reads it); a ring step of other keys visits all or none of a pair, half on average."""
    return (N * M + min(N, M)) / 2


def matmul_flops(B: int, L: int, Q: int, K: int, D: int, S: int, tiling: Tiling, matmuls: int) -> int:
    """FLOPs of `matmuls` block matmuls [block_q, D] x [D, block_k] (or the like) per visited pair
    and query head: 2 per multiply-add (causal_pairs says which pairs)."""
    pairs = causal_pairs(L // tiling.block_q, S // tiling.block_k)
    return math.ceil(B * K * Q * pairs * matmuls * 2 * tiling.block_q * tiling.block_k * D)


# ---------------------------------------------------------------------------------------------
# The arithmetic of one (query block, key block) pair for one query head, the same in both
# lowerings: they differ only in how blocks reach these functions. Operands are the inputs' dtype
# (bf16); every product accumulates in float32. Row statistics (running max m, denominator l, lse,
# delta) are columns [block_q, 1] (rows [1, block_q] in the transposed dk/dv step): the shape a
# reduction over keys gives with keepdims, which broadcasts against the scores as it is.


def visible(q_position, q_doc_start, k_position, k_doc_start):
    """The mask by broadcasting: queries as columns and keys as rows give [block_q, block_k];
    keys as columns (the transposed step) give [block_k, block_q]."""
    return (k_position <= q_position) & (k_doc_start == q_doc_start)


def matmul_nt(a, b):
    """a [m, d] times b [n, d] transposed: [m, n] in float32 (q k^T without a transpose in the kernel)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def matmul(a, b):
    """a [m, d] times b [d, n]: [m, n] in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def softmax_init(block_q: int, head_dim: int):
    """Running max (-inf: no key seen yet), denominator and numerator of one query head's block."""
    return jnp.full((block_q, 1), -jnp.inf, F32), jnp.zeros((block_q, 1), F32), jnp.zeros((block_q, head_dim), F32)


def softmax_step(carry, q, k, v, mask, scale: float):
    """Online softmax (Milakov & Gimelshein 2018): key block (k, v) added to a query block's running
    max m, denominator l = sum exp(s - m) and numerator acc = sum exp(s - m) v, both rescaled when
    the max grows. Masked scores are -inf and add exactly 0. While a query has seen no visible key
    its max stays -inf, and exponents subtract 0 instead (m_safe): no -inf - -inf = NaN, and l = 0."""
    m, l, acc = carry
    s = jnp.where(mask, matmul_nt(q, k) * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    rescale = jnp.exp(m - m_safe)  # 0 at the first visible block: m was -inf
    l = rescale * l + jnp.sum(p, axis=1, keepdims=True)
    acc = rescale * acc + matmul(p.astype(v.dtype), v)
    return m_new, l, acc


def softmax_finish(carry):
    """Output o [block_q, D] (float32) and log-sum-exp [block_q, 1]; a query that saw no key has
    o = 0 and lse = -inf, which a merge over ring steps weighs 0."""
    m, l, acc = carry
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    return acc / l_safe, jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def dq_step(dq, q, do, lse, delta, k, v, mask, scale: float):
    """One key block added to a query block's dq (unscaled: the caller multiplies by scale once).
    The softmax weights P come back from the scores and the saved lse [block_q, 1] (over all the
    ring's keys: then P is this block's share of the whole softmax); dP = dO V^T, and the scores'
    gradient is P * (dP - delta) with delta = rowsum(dO * O) [block_q, 1] (the softmax's Jacobian)."""
    p = jnp.exp(jnp.where(mask, matmul_nt(q, k) * scale - lse, -jnp.inf))
    ds = p * (matmul_nt(do, v) - delta)
    return dq + matmul(ds.astype(k.dtype), k)


def dkv_step(dk, dv, k, v, q, do, lse, delta, mask_t, scale: float):
    """One query block (one query head) added to a key block's dk (unscaled) and dv. Computed
    transposed, keys as rows: S^T = K Q^T [block_k, block_q], so that dV += P^T dO and dK += dS^T Q
    are plain matmuls and lse, delta arrive as rows [1, block_q]."""
    p_t = jnp.exp(jnp.where(mask_t, matmul_nt(k, q) * scale - lse, -jnp.inf))
    dv = dv + matmul(p_t.astype(do.dtype), do)
    ds_t = p_t * (matmul_nt(v, do) - delta)
    return dk + matmul(ds_t.astype(q.dtype), q), dv
