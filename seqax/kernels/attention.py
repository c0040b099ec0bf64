"""Causal grouped-query attention within packed documents: the specification and the kernels.

    dense_attention        every score materialized: the oracle for tests and benchmarks, and
                           sample.py's attention of new tokens over its KV cache (L is small)
    causal_document_mask   which keys each query may see: not later, and in the same document
    reference_attention    training's attention as one readable function: dense_attention over
                           whole rows, its gradient autodiff's (the place to change the math)
    ring_attention         the blockwise kernel in XLA ops: blocks, online softmax, key and value
                           blocks passed around the devices of mesh axis c, a hand-written backward
    kernel_for             which of them (or flash_attention.ring_flash_attention, the Pallas
                           kernels) training runs: model.attention_kernel, "auto" by the platform

Shapes (per device inside shard_map, as train.py's legend names them): q [B, L, Q, K, D],
k and v [B, S, K, D], doc_start [B, L] (where each token's document starts, train.py's
document_positions) and, for ring_attention, row_position [L] (where each of the device's
tokens sits in the row: with context parallelism a device holds two chunks of each row, see
docs/context-parallel.md). Scores accumulate in float32 whatever the operands' dtype.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from seqax.config import ATTENTION_KERNELS
from seqax.jax_extra import save_in_forward_rule
from seqax.kernels.flash_attention import ring_flash_attention
from seqax.shardlib.bits import through_bits
from seqax.shardlib.shardops import all_gather, axis_size, einsum_unreduced, ring_pass
from seqax.shardlib.shardtypes import traced_device


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


def reference_attention(q, k, v, doc_start, row_position, block: int):
    """Training's attention as the specification says it, for every kernel's interface: the keys,
    values, document starts and row positions of all devices of mesh axis c gathered into whole
    rows, then dense_attention with causal_document_mask. Its gradient is autodiff's, so a change of
    the math here (a soft cap on the scores, a bias, another mask) needs no backward pass written by
    hand; it keeps every score of a row at once (L x L per head), so it is slow and large: the
    kernels are checked against it, and model.attention_kernel=reference runs it. k and v cross the
    wire as float32, so that their gradients are summed over c in float32 (the gather's transpose)."""
    del block  # one block: the whole row
    k, v = (all_gather("B/d S/c K/t D -> B/d S K/t D", x.astype(jnp.float32)).astype(x.dtype) for x in (k, v))
    k_doc_start, k_position = all_gather("B/d S/c -> B/d S", doc_start), all_gather("S/c -> S", row_position)
    return dense_attention(q, k, v, causal_document_mask(row_position, k_position, doc_start, k_doc_start))


# Attention by blocks (the algorithm of FlashAttention, Dao et al. 2022, in XLA ops) around a
# ring (Liu et al. 2023, "Ring attention with blockwise transformers"). Each device holds the
# queries, keys and values of its positions of every row, cut into blocks of `attention_block`
# positions; a block is a contiguous run of row positions, so it has a row-wide index
# (position // block). Inside the kernel q, k, v and their gradients are laid out by blocks
# and heads first, [B, N, K, (Q,) block, D], once a layer: each block pair's matmuls then read
# their operands as they lie, batched over B and K, where the row layout [B, L, (Q,) K, D] made
# XLA transpose both operands of every pair. The keys and values go round the c devices of
# the ring, in that layout: at ring step s a device holds those of the device s places before
# it, and every query block visits, one pair at a time, the blocks of that shard it must see:
# not after it, and not wholly before the start of the earliest document among its queries.
# Only one pair's scores [B, K, Q, L, S] exist at once (L, S: positions within a block);
# future blocks and blocks of earlier documents only are never computed. With c = 1 the ring
# is one step over the device's own keys.

# What travels round the ring: k and v as head blocks (M: the shard's blocks, S: a block's
# positions; their gradients travel the same way), doc_start and row_position.
KV_SPECS = ("B/d M/c K/t S D", "B/d M/c K/t S D", "B/d S/c", "S/c")


def to_blocks(x, block: int):
    """[B, L, ...] -> [B, L / block, block, ...]: a reshape, no copy."""
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def to_head_blocks(x, block: int):
    """Queries [B, L, Q, K, D] -> [B, N, K, Q, block, D], keys or values [B, S, K, D] ->
    [B, M, K, block, D]: one transpose a layer, so that no block pair needs one (N = L / block)."""
    x = jnp.moveaxis(to_blocks(x, block), -2, 2)  # K after N
    return jnp.moveaxis(x, 3, -2)  # the block's positions just before D


def from_head_blocks(x):
    """to_head_blocks undone: [B, N, K, (Q,) block, D] -> [B, N * block, (Q,) K, D]."""
    x = jnp.moveaxis(jnp.moveaxis(x, -2, 3), 2, -2)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def block_at(blocks, n):
    """blocks[:, n]: block n [B, ...] of [B, N, ...]. A bfloat16 array is read as its bits
    (shardlib/bits.py): XLA:CPU would hold it as float32 for the loop that slices it."""
    return through_bits(partial(lax.dynamic_index_in_dim, index=n, axis=1, keepdims=False), blocks)


def add_to_block(blocks, j, update):
    """blocks[:, j] += update, in place (a dynamic-update-slice, not a scatter)."""
    return lax.dynamic_update_index_in_dim(blocks, block_at(blocks, j) + update, j, 1)


def block_scores(q_block, k_block, q_doc_start, k_doc_start, q_position, k_position):
    """Scaled scores [B, K, Q, L, S] (float32) of a query block q_block [B, K, Q, L, D] against a
    key block k_block [B, K, S, D]; -1e30 (softmax weight 0) where the key lies in another
    document (doc_start: where each token's document starts) or after the query (position: in
    the row, [L] and [S])."""
    scores = (einsum_unreduced("B/d K/t Q L D, B/d K/t S D -> B/d K/t Q L S", q_block, k_block)
              * (q_block.shape[-1] ** -0.5))
    visible = causal_document_mask(q_position, k_position, q_doc_start, k_doc_start)
    return jnp.where(visible[:, None, None], scores, -1e30)


def key_blocks_to_visit(q_start_blocks, q_position_blocks, k_position_blocks, block: int):
    """For each query block n, the key blocks [first[n], stop[n]) of a shard that it visits. The
    shard's blocks are in row order (a device's chunks are), so those are the ones from the
    block holding the start of the earliest document among the query block's queries (its first
    position, in any row: earlier keys are in other documents for every query of the block)
    up to the query block itself."""
    q_index = (q_position_blocks[:, 0] // block).astype(jnp.int32)  # [N] row-wide block index
    earliest = (jnp.min(q_start_blocks[:, :, 0], axis=0) // block).astype(jnp.int32)  # [N]
    k_index = (k_position_blocks[:, 0] // block).astype(jnp.int32)  # [M], ascending
    first = jnp.sum(k_index[None, :] < earliest[:, None], axis=1)
    stop = jnp.sum(k_index[None, :] <= q_index[:, None], axis=1)
    return first, stop


def own_kv_shard(k, v, doc_start, row_position, block: int):
    """This device's keys and values [B, S, K, D], doc_start [B, S] and row_position [S] as they
    travel the ring (KV_SPECS): k and v as head blocks, transposed once before the ring."""
    return to_head_blocks(k, block), to_head_blocks(v, block), doc_start, row_position


def shard_blocks(shard, block: int):
    """(k, v, doc_start, row_position) of a key and value shard as it travels the ring, k and v
    already head blocks [B, M, K, block, D]: doc_start [B, S] and row_position [S] cut into
    blocks too ([B, M, block] and [M, block])."""
    k_blocks, v_blocks, doc_start, row_position = shard
    return k_blocks, v_blocks, to_blocks(doc_start, block), row_position.reshape(-1, block)


def forward_over_shard(carry, q_blocks, q_start_blocks, q_position_blocks, kv, block: int):
    """One ring step of the forward pass: every query block against the blocks it must see of
    the key and value shard kv = (k and v as head blocks, doc_start, row_position), by online softmax (Milakov &
    Gimelshein 2018): each query keeps a running max, the sum of exp(score - max) and the sum
    of its weighted values (carry, for all query blocks), rescaled whenever the max grows."""
    k_blocks, v_blocks, k_start_blocks, k_position_blocks = shard_blocks(kv, block)
    first, stop = key_blocks_to_visit(q_start_blocks, q_position_blocks, k_position_blocks, block)

    def attend(n_and_carry):
        n, carry = n_and_carry
        q_n, start_n, position_n = block_at(q_blocks, n), block_at(q_start_blocks, n), q_position_blocks[n]

        def add_key_block(step, carry):
            running_max, denominator, numerator = carry
            j = stop[n] - 1 - step  # from the nearest block back
            scores = block_scores(q_n, block_at(k_blocks, j), start_n, block_at(k_start_blocks, j), position_n,
                                  k_position_blocks[j])
            new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
            rescale = jnp.exp(running_max - new_max)
            weights = jnp.exp(scores - new_max[..., None])
            weighted_values = einsum_unreduced("B/d K/t Q L S, B/d K/t S D -> B/d K/t Q L D",
                                               weights.astype(v_blocks.dtype), block_at(v_blocks, j))
            return (new_max, denominator * rescale + jnp.sum(weights, axis=-1),
                    numerator * rescale[..., None] + weighted_values)

        return lax.fori_loop(0, stop[n] - first[n], add_key_block, carry)

    return lax.map(attend, (jnp.arange(q_blocks.shape[1]), carry))


def ring_attention_forward(q_blocks, kv, block: int):
    """Attention output o [B, L, Q, K, D] (q_blocks' dtype) and the log-sum-exp of every query's
    scores [N, B, K, Q, block] (float32), over c ring steps, from the queries as head blocks
    q_blocks [B, N, K, Q, block, D] and this device's key and value shard kv (own_kv_shard)."""
    _, _, q_start_blocks, q_position_blocks = shard_blocks(kv, block)  # the queries' too: kv is this device's own shard
    # Ring step 0 is the device's own shard, whose nearest block to each query block is the
    # diagonal one, where every query sees itself: the running max is a real score from the
    # first pair on, and later fully masked rows add exactly 0 (exp(-1e30 - max)). (full_like
    # and zeros_like: the carry varies over the same mesh axes as q.)
    B, N, K, Q, L, D = q_blocks.shape
    running_max = jnp.full_like(q_blocks, -1e30, jnp.float32, (N, B, K, Q, L))
    carry = (running_max, jnp.zeros_like(running_max), jnp.zeros_like(q_blocks, jnp.float32, (N, B, K, Q, L, D)))

    def ring_step(carry_and_kv, _):
        carry, kv = carry_and_kv
        # sent before this step's work: the transfer can overlap it
        arriving = tuple(ring_pass(spec, x, "c") for spec, x in zip(KV_SPECS, kv))
        return (forward_over_shard(carry, q_blocks, q_start_blocks, q_position_blocks, kv, block), arriving), None

    ((running_max, denominator, numerator), _), _ = lax.scan(ring_step, (carry, kv), None, length=axis_size("c"))
    o_blocks = einsum_unreduced("N B/d K/t Q L D -> B/d N K/t Q L D", numerator / denominator[..., None])
    return from_head_blocks(o_blocks).astype(q_blocks.dtype), running_max + jnp.log(denominator)


def backward_over_shard(q_blocks, do_blocks, delta_blocks, log_sum_exp, q_start_blocks, q_position_blocks, kv,
                        block: int):
    """One ring step of the backward pass, over the same block pairs as the forward pass: this
    device's share of dq [B, N, K, Q, L, D] and of the visiting shard's dk, dv [B, M, K, S, D]
    (float32, head blocks as k and v travel). Each pair's softmax weights P are recomputed from its scores and the saved
    log-sum-exp; with dP = dO V^T, the scores' gradient is P * (dP - rowsum(dO * O))."""
    k_blocks, v_blocks, k_start_blocks, k_position_blocks = shard_blocks(kv, block)
    first, stop = key_blocks_to_visit(q_start_blocks, q_position_blocks, k_position_blocks, block)
    scale = q_blocks.shape[-1] ** -0.5

    def backward_query_block(n, dq_dk_dv):
        q_n, do_n, start_n, position_n = (
            block_at(q_blocks, n), block_at(do_blocks, n), block_at(q_start_blocks, n), q_position_blocks[n])
        delta_n = block_at(delta_blocks, n)  # [B, K, Q, L]

        def add_key_block(step, dq_dk_dv):
            dq, dk, dv = dq_dk_dv
            j = stop[n] - 1 - step
            k_j, v_j = block_at(k_blocks, j), block_at(v_blocks, j)
            scores = block_scores(q_n, k_j, start_n, block_at(k_start_blocks, j), position_n, k_position_blocks[j])
            weights = jnp.exp(scores - log_sum_exp[n][..., None])
            dv = add_to_block(dv, j, einsum_unreduced("B/d K/t Q L S, B/d K/t Q L D -> B/d K/t S D",
                                                      weights.astype(v_blocks.dtype), do_n))
            d_weights = einsum_unreduced("B/d K/t Q L D, B/d K/t S D -> B/d K/t Q L S", do_n, v_j)
            d_scores = (weights * (d_weights - delta_n[..., None]) * scale).astype(q_blocks.dtype)
            dk = add_to_block(dk, j, einsum_unreduced("B/d K/t Q L S, B/d K/t Q L D -> B/d K/t S D", d_scores, q_n))
            return add_to_block(dq, n, einsum_unreduced("B/d K/t Q L S, B/d K/t S D -> B/d K/t Q L D",
                                                        d_scores, k_j)), dk, dv

        return lax.fori_loop(0, stop[n] - first[n], add_key_block, dq_dk_dv)

    dq_dk_dv = tuple(jnp.zeros_like(x, jnp.float32) for x in (q_blocks, k_blocks, v_blocks))
    return lax.fori_loop(0, q_blocks.shape[1], backward_query_block, dq_dk_dv)


def ring_attention_backward(block: int, saved, do):
    """Gradients of q, k, v from the output's gradient do [B, L, Q, K, D]: the ring runs again,
    and the gradients of each key and value shard travel with it, each device adding its share,
    until they come home."""
    q_blocks, kv, o, log_sum_exp = saved
    _, _, q_start_blocks, q_position_blocks = shard_blocks(kv, block)  # the queries' too: kv is this device's own shard
    do_blocks = to_head_blocks(do, block)
    # rowsum(dO * O) = rowsum(dP * P): the softmax's Jacobian applied to dP; [B, N, K, Q, L].
    delta = einsum_unreduced("B/d L Q K/t D, B/d L Q K/t D -> B/d L Q K/t", do, o)
    delta_blocks = einsum_unreduced("B/d N L Q K/t -> B/d N K/t Q L", to_blocks(delta, block))

    def over_shard(kv):
        return backward_over_shard(q_blocks, do_blocks, delta_blocks, log_sum_exp, q_start_blocks, q_position_blocks,
                                   kv, block)

    def ring_step(carry, _):
        dq, kv, dk_dv = carry
        # Both transfers start before this step's work, so that they can overlap it: the next
        # shard, and the gradients of the shard held last step on to its next holder.
        arriving = tuple(ring_pass(spec, x, "c") for spec, x in zip(KV_SPECS, kv))
        dk_in, dv_in = (ring_pass(KV_SPECS[0], g, "c") for g in dk_dv)
        dq_step, dk, dv = over_shard(kv)
        return (dq + dq_step, arriving, (dk_in + dk, dv_in + dv)), None

    # The own shard's step outside the loop: its gradients start the sums (no zeros added or sent), and
    # the loop runs the c - 1 steps of the others' shards.
    arriving = tuple(ring_pass(spec, x, "c") for spec, x in zip(KV_SPECS, kv))
    dq, *dk_dv = over_shard(kv)
    (dq, _, dk_dv), _ = lax.scan(ring_step, (dq, arriving, tuple(dk_dv)), None, length=axis_size("c") - 1)
    dk, dv = (ring_pass(KV_SPECS[0], g, "c") for g in dk_dv)  # the last holder sends them home
    dq, dk, dv = (from_head_blocks(dq.astype(q_blocks.dtype)), from_head_blocks(dk.astype(kv[0].dtype)),
                  from_head_blocks(dv.astype(kv[1].dtype)))
    return dq, dk, dv, None, None  # doc_start and row_position are integers: no cotangent


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def ring_attention(q, k, v, doc_start, row_position, block: int):
    """Causal grouped-query attention within documents of q [B, L, Q, K, D] over k, v [B, S, K, D]
    by blocks of `block` positions, with the keys and values of all devices of mesh axis c;
    doc_start [B, L] is where each token's document starts and row_position [L] where each
    token sits in the row. Runs inside shard_map. The same numbers as dense_attention with
    causal_document_mask over whole rows, up to rounding."""
    return ring_attention_forward(to_head_blocks(q, block), own_kv_shard(k, v, doc_start, row_position, block),
                                  block)[0]


def ring_attention_forward_saving(q, k, v, doc_start, row_position, block: int):
    """The forward pass under differentiation. Kept for the backward pass (marked, so that layer
    rematerialization keeps them too): the head blocks of q, k and v that the kernel reads (the
    backward pass then needs no transpose of them), the output o and its log-sum-exp; doc_start
    and row_position are the layer's arguments."""
    q_blocks = save_in_forward_rule(to_head_blocks(q, block))
    k_blocks, v_blocks, doc_start, row_position = own_kv_shard(k, v, doc_start, row_position, block)
    kv = (save_in_forward_rule(k_blocks), save_in_forward_rule(v_blocks), doc_start, row_position)
    o, log_sum_exp = ring_attention_forward(q_blocks, kv, block)
    o, log_sum_exp = save_in_forward_rule(o), save_in_forward_rule(log_sum_exp)
    return o, (q_blocks, kv, o, log_sum_exp)


ring_attention.defvjp(ring_attention_forward_saving, ring_attention_backward)


def kernel_for(kernel: str, platform: str, device_kind: str = ""):
    """The attention kernel that model.attention_kernel names, for `platform` (JAX's: "cpu", "gpu",
    "tpu") and `device_kind` (JAX's name of the device), as a function (q, k, v, doc_start, row_position,
    block) -> o: "pallas" the flash kernels of the device (flash_attention.lowering_for: Mosaic GPU's on a
    Hopper, Triton's on other GPUs, Mosaic TPU's on a TPU; on a CPU in Pallas's interpret mode, which only
    runs in a shard_map that does not check varying mesh axes: tests/test_flash_attention.py),
    "pallas_triton" and "pallas_hopper" one GPU lowering of them, "blockwise" ring_attention, "reference"
    reference_attention, and "auto" the fastest on the platform: Pallas on GPUs and TPUs, blockwise on
    CPUs. All compute the same attention, up to rounding."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {ATTENTION_KERNELS}")
    if kernel == "auto":
        kernel = "blockwise" if platform == "cpu" else "pallas"
    if kernel.startswith("pallas"):
        return partial(ring_flash_attention, platform=platform, kernel=kernel, device_kind=device_kind)
    return {"blockwise": ring_attention, "reference": reference_attention}[kernel]


def training_attention(kernel: str):
    """kernel_for(kernel, the platform and device kind of the mesh the caller runs on), inside shard_map."""
    return kernel_for(kernel, *traced_device())
