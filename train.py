"""seqax: the model, the loss, the optimizer and the training loop, in one file.

    python -m train --config-name=local_test_synthetic +paths.model_name=RUN [key=value ...]

Dimension names, used the same way in every annotation and spec string:
    B  batch (sequences)             L  positions of queries       S  positions of keys (= L)
    M  d_model                       F  d_ff                       V  vocabulary
    Q  query heads per kv head       K  kv heads                   D  head dimension
    layers  transformer blocks (weights stacked, run with lax.scan)
Mesh axes: `d` splits the batch and, FSDP-style, the weights (gathered one layer at a time);
`t` splits heads, d_ff and vocabulary (tensor parallelism, Megatron-style: the residual stream
is whole on every `t` device and the partial sums of a block are all-reduced over `t`).

Precision: weights, Adam moments, the residual stream and norms in float32; matmul operands in
MATMUL_DTYPE (bfloat16) with float32 accumulation; every sum across devices in float32.

The numbers that a run sets (h: ModelConfig, TrainingConfig, ...) are defined in config.py.
"""

import math
import os
import sys
from functools import partial

import hydra
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from omegaconf import DictConfig, OmegaConf

import training_io
from checkpoint import Checkpointer, PreemptionWatch
from config import Config, ModelConfig, TrainingConfig, validate_config
from data_loader import make_loader
from flat_tokens import DatasetError, open_flat_tokens
from jax_extra import ConfigError, config_from_dict, explicit_activation_checkpointing, fold_in_str, save_for_backward
from multihost import console_name, initialize_distributed
from shardlib.shardops import all_gather, einsum_unreduced, index_unreduced, psum
from shardlib.shardtypes import Array, bool_, f32, make_partition_specs, make_shardings, pytree_dataclass, spec_axes, typechecked, typed_shard_map, u32

# ---------------------------------------------------------------------------------------------
# Operands of every matmul are cast to this type; products accumulate in float32. bfloat16 is the
# fast path on every accelerator; with float32 a step is exact up to the order of sums (the
# model tests use that to check the math against tests/reference.py).
MATMUL_DTYPE = jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# Weights. Every field says its shape and sharding; the Adam moments have the same types.


@pytree_dataclass
class Layer:
    attn_norm: f32[b"M"]
    w_q: f32[b"M/d Q K/t D"]
    w_k: f32[b"M/d K/t D"]
    w_v: f32[b"M/d K/t D"]
    w_o: f32[b"Q K/t D M/d"]
    ffn_norm: f32[b"M"]
    w_gate: f32[b"M/d F/t"]
    w_up: f32[b"M/d F/t"]
    w_down: f32[b"F/t M/d"]


@pytree_dataclass
class Model:
    embed: f32[b"V/t M/d"]
    layers: Array[b"layers", Layer]
    final_norm: f32[b"M"]
    unembed: f32[b"M/d V/t"]


@pytree_dataclass
class State:
    weights: Model
    adam_mu: Model
    adam_nu: Model


@pytree_dataclass
class Metrics:
    loss: f32[b""]
    learning_rate: f32[b""]
    grad_norm: f32[b""]


def init_weights(h: ModelConfig, key: jax.Array) -> Model:
    """Normal weights with std 1/sqrt(fan_in) (embeddings: std 1), norms at 1. Run under jit
    with sharded outputs: each device draws only its shard, and the values do not depend on
    the mesh (threefry is partitionable)."""
    M, Q, K, D, F, V, n = h.d_model, h.n_q_per_kv, h.n_kv, h.d_head, h.d_ff, h.vocab, h.layers

    def normal(name, shape, fan_in):
        return jax.random.normal(fold_in_str(key, name), shape, jnp.float32) / math.sqrt(fan_in)

    layers = Layer(
        attn_norm=jnp.ones((n, M)),
        w_q=normal("w_q", (n, M, Q, K, D), M),
        w_k=normal("w_k", (n, M, K, D), M),
        w_v=normal("w_v", (n, M, K, D), M),
        w_o=normal("w_o", (n, Q, K, D, M), Q * K * D),
        ffn_norm=jnp.ones((n, M)),
        w_gate=normal("w_gate", (n, M, F), M),
        w_up=normal("w_up", (n, M, F), M),
        w_down=normal("w_down", (n, F, M), F),
    )
    return Model(embed=normal("embed", (V, M), 1), layers=layers, final_norm=jnp.ones((M,)), unembed=normal("unembed", (M, V), M))


# ---------------------------------------------------------------------------------------------
# The model. Everything below runs inside shard_map: shapes are per device.


def rms_norm(x, weight, eps: float):
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, in float32."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


@typechecked
def document_positions(is_seq_start: bool_[b"B/d L"]) -> tuple[u32[b"B/d L"], u32[b"B/d L"]]:
    """(where its document starts, position within the document) of every token. Positions
    restart at each document so that a packed document sees the same RoPE phases as one
    generated alone. A row's first tokens belong to a document that started earlier (start 0)
    unless is_seq_start says otherwise."""
    index = jnp.arange(is_seq_start.shape[1], dtype=jnp.uint32)
    doc_start = lax.cummax(jnp.where(is_seq_start, index, 0), axis=1)
    return doc_start, index - doc_start


def rope(x, position, base: float):
    """Rotary embedding (RoFormer, Su et al. 2021) on the last dim, rotate-half layout.
    x: [B, L, ..., D] float32, position: [B, L]."""
    D = x.shape[-1]
    inverse_timescale = base ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)  # [D/2]
    angle = position.astype(jnp.float32)[..., None] * inverse_timescale  # [B, L, D/2]
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + angle.shape[2:])
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_qkv(h: ModelConfig, x, w: Layer, position):
    """The rotated queries and keys and the values of the tokens x (MATMUL_DTYPE). sample.py
    writes k and v into its KV cache."""
    nx = save_for_backward(rms_norm(x, w.attn_norm, h.norm_eps).astype(MATMUL_DTYPE))
    # FSDP: gather this layer's weights over d in float32 (so that their gradients, the
    # transpose, are reduce-scattered in float32), then cast for the matmul.
    w_q = all_gather("M/d Q K/t D -> M Q K/t D", w.w_q).astype(MATMUL_DTYPE)
    w_k = all_gather("M/d K/t D -> M K/t D", w.w_k).astype(MATMUL_DTYPE)
    w_v = all_gather("M/d K/t D -> M K/t D", w.w_v).astype(MATMUL_DTYPE)
    q = einsum_unreduced("B/d L M, M Q K/t D -> B/d L Q K/t D", nx, w_q)
    k = einsum_unreduced("B/d S M, M K/t D -> B/d S K/t D", nx, w_k)
    v = save_for_backward(einsum_unreduced("B/d S M, M K/t D -> B/d S K/t D", nx, w_v).astype(MATMUL_DTYPE))
    q = save_for_backward(rope(q, position, h.rope_base).astype(MATMUL_DTYPE))
    k = save_for_backward(rope(k, position, h.rope_base).astype(MATMUL_DTYPE))
    return q, k, v


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
    causal = i * block + jnp.arange(block)[:, None] >= j * block + jnp.arange(block)[None, :]
    visible = (q_doc_start[:, :, None] == k_doc_start[:, None, :]) & causal
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
    same numbers as sample.dense_attention with the same mask, up to rounding."""
    return blockwise_attention_forward(q, k, v, doc_start, block)[0]


def blockwise_attention_forward_saving(q, k, v, doc_start, block: int):
    """The forward pass under differentiation: the output and its log-sum-exp are kept for the
    backward pass (marked, so that layer rematerialization keeps them too)."""
    o, log_sum_exp = blockwise_attention_forward(q, k, v, doc_start, block)
    o, log_sum_exp = save_for_backward(o), save_for_backward(log_sum_exp)
    return o, (q, k, v, o, log_sum_exp, doc_start)


blockwise_attention.defvjp(blockwise_attention_forward_saving, blockwise_attention_backward)


def attention_output(h: ModelConfig, o, w: Layer):
    """The attention block's output [B, L, M]: the heads' outputs o [B, L, Q, K, D] projected."""
    w_o = all_gather("Q K/t D M/d -> Q K/t D M", w.w_o).astype(MATMUL_DTYPE)
    out = einsum_unreduced("B/d L Q K/t D, Q K/t D M -> B/d L M", o, w_o)  # partial over t
    return psum("B/d L M", out, "t")


def attention(h: ModelConfig, x, w: Layer, doc_start, position):
    """Grouped-query attention (Ainslie et al. 2023): Q query heads share each of the K kv heads;
    causal, and no query sees another document's keys."""
    q, k, v = attention_qkv(h, x, w, position)
    return attention_output(h, blockwise_attention(q, k, v, doc_start, h.attention_block), w)


def feed_forward(h: ModelConfig, x, w: Layer):
    """SwiGLU (Shazeer 2020): (silu(x W_gate) * x W_up) W_down."""
    nx = save_for_backward(rms_norm(x, w.ffn_norm, h.norm_eps).astype(MATMUL_DTYPE))
    w_gate = all_gather("M/d F/t -> M F/t", w.w_gate).astype(MATMUL_DTYPE)
    w_up = all_gather("M/d F/t -> M F/t", w.w_up).astype(MATMUL_DTYPE)
    gate = save_for_backward(einsum_unreduced("B/d L M, M F/t -> B/d L F/t", nx, w_gate).astype(MATMUL_DTYPE))
    up = save_for_backward(einsum_unreduced("B/d L M, M F/t -> B/d L F/t", nx, w_up).astype(MATMUL_DTYPE))
    hidden = (gate * jax.nn.sigmoid(gate) * up).astype(MATMUL_DTYPE)
    w_down = all_gather("F/t M/d -> F/t M", w.w_down).astype(MATMUL_DTYPE)
    out = einsum_unreduced("B/d L F/t, F/t M -> B/d L M", hidden, w_down)  # partial over t
    return psum("B/d L M", out, "t")


@typechecked
def transformer_layer(h: ModelConfig, x: f32[b"B/d L M"], w: Layer, doc_start: u32[b"B/d L"], position: u32[b"B/d L"]) -> f32[b"B/d L M"]:
    x = save_for_backward(x + attention(h, x, w, doc_start, position))
    return x + feed_forward(h, x, w)


def embed_tokens(w: Model, inputs):
    """The residual stream [B/d, L, M] (float32) of input tokens [B/d, L]."""
    embed = all_gather("V/t M/d -> V/t M", w.embed)
    return psum("B/d L M", index_unreduced("V/t M, B/d L -> B/d L M", embed, inputs), "t")


def output_logits(h: ModelConfig, w: Model, x):
    """Next-token logits [B/d, L, V/t] (float32, this device's slice of V) of the residual stream x."""
    nx = rms_norm(x, w.final_norm, h.norm_eps).astype(MATMUL_DTYPE)
    unembed = all_gather("M/d V/t -> M V/t", w.unembed).astype(MATMUL_DTYPE)
    return einsum_unreduced("B/d L M, M V/t -> B/d L V/t", nx, unembed)


@typechecked
def forward(h: ModelConfig, w: Model, inputs: u32[b"B/d L"], is_seq_start: bool_[b"B/d L"]) -> f32[b"B/d L V/t"]:
    """Next-token logits at every position of packed documents. The input of a document's
    first position is token 0 (begin of document)."""
    if inputs.shape[1] % h.attention_block:
        raise ConfigError(f"model.attention_block={h.attention_block} must divide the sequence length {inputs.shape[1]}")
    doc_start, position = document_positions(is_seq_start)
    x = embed_tokens(w, inputs)

    @explicit_activation_checkpointing
    def body(x, layer_weights):
        return transformer_layer(h, x, layer_weights, doc_start, position), None

    x, _ = lax.scan(body, x, w.layers)
    return output_logits(h, w, x)


@typechecked
def model_loss(h: ModelConfig, w: Model, targets: u32[b"B/d L"], is_seq_start: bool_[b"B/d L"], loss_mask: bool_[b"B/d L"]) -> f32[b""]:
    """This device's share of the mean next-token cross-entropy over the global batch's real
    tokens (loss_mask is False on padding). Each document's first token is predicted from
    input token 0, so every real token is a target."""
    inputs = jnp.where(is_seq_start, 0, jnp.pad(targets[:, :-1], ((0, 0), (1, 0))))
    logits = forward(h, w, inputs, is_seq_start)  # float32
    # Cross-entropy over a vocabulary split across t: log-sum-exp and the target's logit each
    # need one sum over t.
    max_logit = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), "t")
    sum_exp = psum("B/d L", jnp.sum(jnp.exp(logits - max_logit[..., None]), axis=-1), "t")
    V_local = logits.shape[-1]
    local_target = targets.astype(jnp.int32) - lax.axis_index("t") * V_local
    here = (local_target >= 0) & (local_target < V_local)
    target_logit = jnp.take_along_axis(logits, jnp.clip(local_target, 0, V_local - 1)[..., None], axis=-1)[..., 0]
    target_logit = psum("B/d L", jnp.where(here, target_logit, 0.0), "t")
    token_losses = max_logit + jnp.log(sum_exp) - target_logit
    global_tokens = lax.psum(jnp.sum(loss_mask, dtype=jnp.float32), "d")
    return jnp.sum(jnp.where(loss_mask, token_losses, 0.0)) / jnp.maximum(global_tokens, 1.0)


# ---------------------------------------------------------------------------------------------
# Optimizer: AdamW with bias correction (Kingma & Ba 2015, Alg. 1; Loshchilov & Hutter 2019),
# global-norm clipping, linear warmup then cosine decay.


def learning_rate(h: TrainingConfig, step):
    """Rate used by step `step` (0-based): linear warmup over warmup_steps to the peak, then
    cosine decay to final_learning_rate_fraction of the peak at the last step."""
    step = step.astype(jnp.float32)
    warmup = (step + 1) / max(h.warmup_steps, 1)
    progress = jnp.clip((step - h.warmup_steps) / max(h.steps - 1 - h.warmup_steps, 1), 0.0, 1.0)
    cosine = h.final_learning_rate_fraction + (1 - h.final_learning_rate_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return h.learning_rate * jnp.where(step < h.warmup_steps, warmup, cosine)


def adamw_update(h: TrainingConfig, step, lr, clip_scale, w, g, mu, nu):
    """One AdamW step of one weight array; `clip_scale` scales the gradient first."""
    g = g * clip_scale
    mu = h.adam_b1 * mu + (1 - h.adam_b1) * g
    nu = h.adam_b2 * nu + (1 - h.adam_b2) * g * g
    t = step.astype(jnp.float32) + 1
    mu_hat = mu / (1 - h.adam_b1**t)
    nu_hat = nu / (1 - h.adam_b2**t)
    w = w - lr * (mu_hat / (jnp.sqrt(nu_hat) + h.adam_eps) + h.weight_decay * w)
    return w, mu, nu


def clip_scale(h: TrainingConfig, grad_norm):
    return jnp.minimum(1.0, h.grad_clip / jnp.maximum(grad_norm, 1e-30))


def optimizer_step(h: TrainingConfig, step, weights, grads, adam_mu, adam_nu, grad_norm):
    """AdamW on every leaf. `grad_norm` is the global norm; no other cross-device work."""
    lr = learning_rate(h, step)
    scale = clip_scale(h, grad_norm)
    updated = jax.tree.map(partial(adamw_update, h, step, lr, scale), weights, grads, adam_mu, adam_nu)
    is_triple = lambda x: isinstance(x, tuple)  # noqa: E731
    pick = lambda i: jax.tree.map(lambda u: u[i], updated, is_leaf=is_triple)  # noqa: E731
    return pick(0), pick(1), pick(2), lr


# ---------------------------------------------------------------------------------------------
# The training step: one jitted function, state donated.


@partial(jax.jit, static_argnames=("h",), donate_argnames=("state",))
def training_step(state: State, step, targets, is_seq_start, loss_mask, h: Config) -> tuple[State, Metrics]:
    weight_specs = make_partition_specs(Model)

    @typed_shard_map
    def step_on_device(
        state: State, step: u32[b""], targets: u32[b"B/d L"], is_seq_start: bool_[b"B/d L"], loss_mask: bool_[b"B/d L"]
    ) -> tuple[State, Metrics]:
        loss, grads = jax.value_and_grad(partial(model_loss, h.model))(state.weights, targets, is_seq_start, loss_mask)
        loss = lax.psum(loss, "d")  # outside autodiff: the gradients are already global
        # Each gradient is sharded as its weight: its squares are summed over the axes that
        # split it, with one all-reduce per distinct set of axes (not one per weight).
        squares_by_axes: dict[tuple[str, ...], list] = {}
        for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(weight_specs, is_leaf=lambda x: isinstance(x, P))):
            squares_by_axes.setdefault(tuple(sorted(spec_axes(spec))), []).append(jnp.sum(g * g))
        grad_norm = jnp.sqrt(sum(lax.psum(sum(parts), axes) if axes else sum(parts) for axes, parts in squares_by_axes.items()))
        weights, mu, nu, lr = optimizer_step(h.training, step, state.weights, grads, state.adam_mu, state.adam_nu, grad_norm)
        return State(weights, mu, nu), Metrics(loss, lr, grad_norm)

    return step_on_device(state, step, targets, is_seq_start, loss_mask)


@partial(jax.jit, static_argnames=("h",))
def eval_step(weights: Model, targets, is_seq_start, loss_mask, h: Config) -> jax.Array:
    """The training loss of one batch (model_loss, the same function), without gradients or update."""

    @typed_shard_map
    def loss_on_device(w: Model, targets: u32[b"B/d L"], is_seq_start: bool_[b"B/d L"], loss_mask: bool_[b"B/d L"]) -> f32[b""]:
        return lax.psum(model_loss(h.model, w, targets, is_seq_start, loss_mask), "d")

    return loss_on_device(weights, targets, is_seq_start, loss_mask)


def evaluate(h: Config, weights: Model, loader) -> float:
    """eval_loss: the mean of the losses of batches 0..eval_batches-1 of the validation loader,
    the same batches at every evaluation, on any mesh and after any restart."""
    losses = []
    for i in range(h.eval_batches):
        batch = loader.batch(i)
        losses.append(eval_step(weights, batch.targets, batch.is_seq_start, batch.loss_mask, h))
    return float(jnp.mean(jnp.stack(losses)))


def init_state(h: Config, mesh) -> State:
    shardings = make_shardings(State, mesh)

    @partial(jax.jit, out_shardings=shardings)
    def init():
        weights = init_weights(h.model, jax.random.key(h.training.seed))
        zeros = jax.tree.map(jnp.zeros_like, weights)
        return State(weights, zeros, zeros)

    return init()


# ---------------------------------------------------------------------------------------------
# The loop.


def compile_training_step(h: Config, state: State, mesh):
    """training_step compiled ahead of time for this state (arrays or ShapeDtypeStructs) and
    batches of the config's shape split over d, as the loader makes them, so that the run reports
    its compile time, FLOPs and memory before the first step; the loop runs it."""
    shape, sharding = (h.training.tokens.batch, h.training.tokens.len), jax.NamedSharding(mesh, P("d", None))
    batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for dtype in (jnp.uint32, jnp.bool_, jnp.bool_)]
    return training_step.lower(state, jnp.uint32(0), *batch, h).compile()


def memory_annotations(h: Config, mesh) -> tuple[list[str], jax.ShapeDtypeStruct]:
    """For the memory report, per device: what one transformer layer keeps for its backward pass
    (print_saved_residuals lines: its input x, its weights and every save_for_backward) and the
    float32 logits (B/d L V/t)."""
    B, L, M, d, t = h.training.tokens.batch, h.training.tokens.len, h.model.d_model, h.mesh.d, h.mesh.t
    lines = []

    @typed_shard_map
    def probe(x: f32[b"B/d L M"], w: Layer, doc_start: u32[b"B/d L"], position: u32[b"B/d L"]) -> f32[b""]:
        body = explicit_activation_checkpointing(lambda x, w: transformer_layer(h.model, x, w, doc_start, position))
        lines.extend(training_io.saved_residuals(body, x, w))
        return jnp.zeros(())

    batch_sharded = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, P("d")))  # noqa: E731
    layer = jax.eval_shape(lambda: jax.tree.map(lambda w: w[0], init_weights(h.model, jax.random.key(0)).layers))
    layer = jax.tree.map(lambda w, s: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s), layer, make_shardings(Layer, mesh))
    jax.eval_shape(probe, batch_sharded((B, L, M), jnp.float32), layer, batch_sharded((B, L), jnp.uint32), batch_sharded((B, L), jnp.uint32))
    return lines, jax.ShapeDtypeStruct((B // d, L, h.model.vocab // t), jnp.float32)


def make_mesh(d: int, t: int, devices=None) -> jax.sharding.Mesh:
    """The (d, t) mesh over `devices` (default: all). Auto axes: arrays are placed with the
    NamedShardings derived from their annotations, so no explicit-sharding types are needed."""
    return jax.make_mesh((d, t), ("d", "t"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def train(h: Config, resolved_yaml: str):
    dataset = open_flat_tokens(h.dataset.path)
    validate_config(h, jax.device_count(), dataset.max_token_id)
    mesh = make_mesh(h.mesh.d, h.mesh.t)
    loader = make_loader(h.dataset, dataset, "train", h.training.tokens.batch, h.training.tokens.len, mesh)
    eval_loader = make_loader(h.dataset, dataset, "validation", h.training.tokens.batch, h.training.tokens.len, mesh) if h.eval_batches else None
    run_dir = os.path.join(h.paths.root_working_dir, h.paths.model_name)
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), h.checkpoints)
    # Checkpoint N holds the state after N steps, so resuming from it runs step N next. A
    # checkpoint that does not fit the config stops the run here, before anything is written.
    restored = checkpointer.restore(jax.eval_shape(lambda: init_state(h, mesh)), make_shardings(State, mesh))
    log = training_io.RunLog(run_dir, resolved_yaml, h, start=restored[0] if restored else 0)
    with jax.set_mesh(mesh), PreemptionWatch() as preemption:
        start, state = restored or (0, init_state(h, mesh))
        # Compile time, FLOPs, optimized HLO and memory report, before the first step runs.
        step_fn = log.compile(lambda: compile_training_step(h, state, mesh))
        log.memory_report(step_fn, state, *memory_annotations(h, mesh))
        pending = None  # log step s after dispatching step s+1, so logging never stalls the device
        try:
            for step in range(start, h.training.steps):
                batch = loader.batch(step)
                log.before_step(step, state)  # the profiler trace covers two steps after the first
                state, metrics = step_fn(state, jnp.uint32(step), batch.targets, batch.is_seq_start, batch.loss_mask)
                if pending is not None:
                    log.step(*pending)
                pending = (step, metrics)
                log.after_step(step, metrics)
                checkpointer.check()  # a failed background write stops training here
                preempted, done = preemption.reached(step), step + 1
                if preempted or done == h.training.steps or (h.checkpoint_interval > 0 and done % h.checkpoint_interval == 0):
                    log.step(*pending)  # every step a checkpoint holds is logged before it commits
                    pending = None
                    checkpointer.save(done, state)  # returns after the device-to-host copy
                if eval_loader is not None and (done == h.training.steps or (h.eval_interval > 0 and done % h.eval_interval == 0)):
                    if pending is not None:
                        log.step(*pending)  # lines stay in step order
                        pending = None
                    log.eval(done, evaluate(h, state.weights, eval_loader))
                if preempted:
                    print(f"{console_name()}: preempted: checkpoint {done} is being written; exiting", file=sys.stderr, flush=True)
                    break
            if pending is not None:
                log.step(*pending)
        finally:
            loader.close()  # stops the prefetch threads
            if eval_loader is not None:
                eval_loader.close()
            checkpointer.close()  # waits for the write in flight
    log.close()
    return state


@hydra.main(config_path="configs", config_name=None, version_base=None)
def main(cfg: DictConfig):
    try:
        h = config_from_dict(Config, OmegaConf.to_container(cfg, resolve=True))
        initialize_distributed(h.distributed)  # before any other JAX call
        train(h, OmegaConf.to_yaml(cfg, resolve=True))
    except (ConfigError, DatasetError) as e:
        print(f"{console_name()}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        # A collective whose peer died fails here (its connection is reset, or it times out).
        first = str(e).strip().splitlines()[0]
        print(f"{console_name()}: error: {first}; with {jax.process_count()} processes this usually means that another process "
              "died (see its log)", file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: jax.distributed's shutdown would wait for the dead process at exit


if __name__ == "__main__":
    main()
