"""Causal grouped-query attention within packed documents: the specification and the kernels.

    dense_attention        every score materialized: the oracle for tests and benchmarks, and
                           sample.py's attention of new tokens over its KV cache (L is small)
    causal_document_mask   which keys each query may see: not later, and in the same document
    blockwise_attention    the training kernel: blocks, online softmax, a hand-written backward

Shapes (per device inside shard_map, as train.py's legend names them): q [B, L, Q, K, D],
k and v [B, S, K, D], doc_start [B, L] (where each token's document starts, train.py's
document_positions). Scores accumulate in float32 whatever the operands' dtype.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_extra import save_for_backward
from shardlib.shardops import einsum_unreduced


def causal_document_mask(q_position, k_position, q_doc_start, k_doc_start):
    """[B, L, S]: True where a query may see a key: the key is not after the query (positions in
    the row, [L] and [S]) and both lie in the same document (doc_start [B, L] and [B, S])."""
    causal = q_position[:, None] >= k_position[None, :]
    return causal & (q_doc_start[:, :, None] == k_doc_start[:, None, :])


def dense_attention(q, k, v, mask):
    """Attention of queries q [B, L, Q, K, D] over keys and values k, v [B, S, K, D] with the
    L x S scores materialized; mask [B, L, S] is True where a query may see a key (every query
    must see at least one key)."""
    logits = einsum_unreduced("B/d L Q K/t D, B/d S K/t D -> B/d Q K/t L S", q, k) * (q.shape[-1] ** -0.5)
    logits = jnp.where(mask[:, None, None, :, :], logits, -1e30)
    logits = logits - lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    probs = jnp.exp(logits)
    probs = (probs / jnp.sum(probs, axis=-1, keepdims=True)).astype(v.dtype)
    return einsum_unreduced("B/d Q K/t L S, B/d S K/t D -> B/d L Q K/t D", probs, v).astype(q.dtype)


# Attention by blocks (the algorithm of FlashAttention, Dao et al. 2022, in XLA ops). The
# sequence is cut into N blocks of `attention_block` positions. Query block i visits key blocks
# i, i-1, ... in a loop, one pair at a time, so only one pair's scores [B, Q, K, L, S] exist at
# once (L, S: positions within a block), and it stops at the first block that any of its
# queries' documents reaches: blocks above the diagonal (the future) and blocks of earlier
# documents only are never computed.


def to_blocks(x, block: int):
    """[B, L, ...] -> [L / block, B, block, ...]: the block index first, so that a loop step
    reads one contiguous block."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:]), 1, 0)


def from_blocks(x):
    """[N, B, block, ...] -> [B, N * block, ...]."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def add_to_block(blocks, j, update):
    """blocks[j] += update, in place (a dynamic-update-slice, not a scatter)."""
    return lax.dynamic_update_index_in_dim(blocks, lax.dynamic_index_in_dim(blocks, j, keepdims=False) + update, j, 0)


def block_scores(q_block, k_block, q_doc_start, k_doc_start, i, j):
    """Scaled scores [B, Q, K, L, S] (float32) of query block i, q_block [B, L, Q, K, D], against
    key block j, k_block [B, S, K, D]; -1e30 (softmax weight 0) where the key lies in another
    document (doc_start: where each token's document starts) or after the query."""
    block = q_block.shape[1]
    scores = einsum_unreduced("B/d L Q K/t D, B/d S K/t D -> B/d Q K/t L S", q_block, k_block) * (q_block.shape[-1] ** -0.5)
    visible = causal_document_mask(i * block + jnp.arange(block), j * block + jnp.arange(block), q_doc_start, k_doc_start)
    return jnp.where(visible[:, None, None], scores, -1e30)


def key_blocks_to_visit(doc_start_blocks, block: int):
    """For each query block i, how many key blocks it visits, from i back to the block holding
    the start of the earliest document among its queries (the block's first position, in any
    row): earlier keys are in other documents for every query of the block."""
    first_key_block = (jnp.min(doc_start_blocks[:, :, 0], axis=1) // block).astype(jnp.int32)  # [N]
    return jnp.arange(doc_start_blocks.shape[0]) - first_key_block + 1


def blockwise_attention_forward(q, k, v, doc_start, block: int):
    """Attention output o [B, L, Q, K, D] (q's dtype) and the log-sum-exp of every query's
    scores [N, B, Q, K, L] (float32), by online softmax (Milakov & Gimelshein 2018): each
    query keeps a running max, the sum of exp(score - max) and the sum of its weighted values,
    rescaled whenever the max grows."""
    q_blocks, k_blocks, v_blocks, start_blocks = (to_blocks(x, block) for x in (q, k, v, doc_start))
    visits = key_blocks_to_visit(start_blocks, block)

    def attend(i):
        q_i, start_i = q_blocks[i], start_blocks[i]

        def add_key_block(step, carry):
            running_max, denominator, numerator = carry
            j = i - step
            scores = block_scores(q_i, k_blocks[j], start_i, start_blocks[j], i, j)
            new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
            rescale = jnp.exp(running_max - new_max)
            weights = jnp.exp(scores - new_max[..., None])
            weighted_values = einsum_unreduced("B/d Q K/t L S, B/d S K/t D -> B/d Q K/t L D", weights.astype(v.dtype), v_blocks[j])
            return new_max, denominator * rescale + jnp.sum(weights, axis=-1), numerator * rescale[..., None] + weighted_values

        # The diagonal block comes first and every query sees itself there, so the running max
        # is a real score from the first step on and later fully masked rows add exactly 0.
        # (full_like and zeros_like: the loop's carry varies over the same mesh axes as q.)
        B, L, Q, K, D = q_i.shape
        running_max = jnp.full_like(q_i, -1e30, jnp.float32, (B, Q, K, L))
        carry = (running_max, jnp.zeros_like(running_max), jnp.zeros_like(q_i, jnp.float32, (B, Q, K, L, D)))
        running_max, denominator, numerator = lax.fori_loop(0, visits[i], add_key_block, carry)
        o_i = einsum_unreduced("B/d Q K/t L D -> B/d L Q K/t D", numerator / denominator[..., None])
        return o_i.astype(q.dtype), running_max + jnp.log(denominator)

    o_blocks, log_sum_exp = lax.map(attend, jnp.arange(q_blocks.shape[0]))
    return from_blocks(o_blocks), log_sum_exp


def blockwise_attention_backward(block: int, saved, do):
    """Gradients of q, k, v from the output's gradient do [B, L, Q, K, D], over the same block
    pairs as the forward pass. Each pair's softmax weights P are recomputed from its scores and
    the saved log-sum-exp; with dP = dO V^T, the scores' gradient is P * (dP - rowsum(dO * O))."""
    q, k, v, o, log_sum_exp, doc_start = saved
    q_blocks, k_blocks, v_blocks, do_blocks, start_blocks = (to_blocks(x, block) for x in (q, k, v, do, doc_start))
    # rowsum(dO * O) = rowsum(dP * P): the softmax's Jacobian applied to dP.
    delta_blocks = to_blocks(einsum_unreduced("B/d L Q K/t D, B/d L Q K/t D -> B/d L Q K/t", do, o), block)
    visits = key_blocks_to_visit(start_blocks, block)
    scale = q.shape[-1] ** -0.5

    def backward_query_block(dk_dv, i):
        q_i, do_i, start_i = q_blocks[i], do_blocks[i], start_blocks[i]
        delta_i = jnp.moveaxis(delta_blocks[i], 1, 3)  # [B, Q, K, L]

        def add_key_block(step, carry):
            dq_i, dk, dv = carry
            j = i - step
            scores = block_scores(q_i, k_blocks[j], start_i, start_blocks[j], i, j)
            weights = jnp.exp(scores - log_sum_exp[i][..., None])
            dv = add_to_block(dv, j, einsum_unreduced("B/d Q K/t L S, B/d L Q K/t D -> B/d S K/t D", weights.astype(v.dtype), do_i))
            d_weights = einsum_unreduced("B/d L Q K/t D, B/d S K/t D -> B/d Q K/t L S", do_i, v_blocks[j])
            d_scores = (weights * (d_weights - delta_i[..., None]) * scale).astype(q.dtype)
            dk = add_to_block(dk, j, einsum_unreduced("B/d Q K/t L S, B/d L Q K/t D -> B/d S K/t D", d_scores, q_i))
            return dq_i + einsum_unreduced("B/d Q K/t L S, B/d S K/t D -> B/d L Q K/t D", d_scores, k_blocks[j]), dk, dv

        dq_i, dk, dv = lax.fori_loop(0, visits[i], add_key_block, (jnp.zeros_like(q_i, jnp.float32), *dk_dv))
        return (dk, dv), dq_i

    dk_dv = (jnp.zeros_like(k_blocks, jnp.float32), jnp.zeros_like(v_blocks, jnp.float32))
    (dk, dv), dq = lax.scan(backward_query_block, dk_dv, jnp.arange(q_blocks.shape[0]))
    return from_blocks(dq).astype(q.dtype), from_blocks(dk).astype(k.dtype), from_blocks(dv).astype(v.dtype), None


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def blockwise_attention(q, k, v, doc_start, block: int):
    """Causal grouped-query attention within documents of q [B, L, Q, K, D] over k, v [B, L, K, D]
    by blocks of `block` positions; doc_start [B, L] is where each token's document starts. The
    same numbers as dense_attention with causal_document_mask, up to rounding."""
    return blockwise_attention_forward(q, k, v, doc_start, block)[0]


def blockwise_attention_forward_saving(q, k, v, doc_start, block: int):
    """The forward pass under differentiation: the output and its log-sum-exp are kept for the
    backward pass (marked, so that layer rematerialization keeps them too)."""
    o, log_sum_exp = blockwise_attention_forward(q, k, v, doc_start, block)
    o, log_sum_exp = save_for_backward(o), save_for_backward(log_sum_exp)
    return o, (q, k, v, o, log_sum_exp, doc_start)


blockwise_attention.defvjp(blockwise_attention_forward_saving, blockwise_attention_backward)
