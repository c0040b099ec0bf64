"""seqax: the model, the loss, the optimizer and the training loop, in one file.

    python -m train --config-name=local_test_synthetic +paths.model_name=RUN [key=value ...]

Dimension names, used the same way in every annotation and spec string:
    B  batch (sequences)             L  positions of queries       S  positions of keys (= L)
    M  d_model                       F  d_ff                       V  vocabulary
    Q  query heads per kv head       K  kv heads                   D  head dimension
    R  RoPE frequencies (D / 2)
    layers  transformer blocks (weights stacked, run with lax.scan)
Mesh axes: `d` splits the batch and, FSDP-style, the weights (gathered one layer at a time, sent
as MATMUL_DTYPE; their gradients come back reduce-scattered in float32); `t` splits heads, d_ff
and vocabulary (tensor parallelism, Megatron-style) and, between blocks, the residual stream's
M (`B/d L/c M/t`): each block all-gathers it over t before its norm and reduce-scatters its
output; `c` splits every row's positions (context parallelism: each device holds two chunks of
each row, data_loader.zigzag_chunks; attention passes keys and values around the c ring) and,
with d, the weights.

Precision: weights, Adam moments, the residual stream and norms in float32; matmul operands in
MATMUL_DTYPE (bfloat16) with float32 accumulation; every sum across devices in float32.

Names: `cfg` is a run's Config, `h` its model section (ModelConfig), `training` its
TrainingConfig; all are defined in config.py. The attention kernels are in attention.py.
"""

import contextlib
import math
import os
import signal
import sys
from functools import partial

if __name__ == "__main__":  # `python -m train`: a SIGTERM during the seconds of the imports below gets multihost's line too
    signal.signal(signal.SIGTERM, lambda signum, frame: (os.write(2, b"seqax: error: stopped by SIGTERM before the training loop, with no step to save; "
                                                                      b"a restart resumes from the newest checkpoint\n"), os._exit(128 + signum)))

import hydra
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from omegaconf import DictConfig, OmegaConf

import run_lock
import training_io
from attention import ring_attention
from checkpoint import Checkpointer, PreemptionWatch
from config import Config, ModelConfig, SeqaxError, TrainingConfig, check_attention_blocks, config_from_dict, validate_config
from data_loader import make_loader, zigzag_chunks
from flat_tokens import open_flat_tokens
from jax_extra import explicit_activation_checkpointing, fold_in_str, save_for_backward
from memory import check_step_fits
from multihost import console_name, exit_if_peer_lost, exit_on_sigterm, initialize_distributed, leave
from shardlib.shardops import all_gather, all_gather_cast, axis_size, einsum_unreduced, index_unreduced, psum, psum_scatter, take_unreduced
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
    w_q: f32[b"M/d/c Q K/t D"]
    w_k: f32[b"M/d/c K/t D"]
    w_v: f32[b"M/d/c K/t D"]
    w_o: f32[b"Q K/t D M/d/c"]
    ffn_norm: f32[b"M"]
    w_gate: f32[b"M/d/c F/t"]
    w_up: f32[b"M/d/c F/t"]
    w_down: f32[b"F/t M/d/c"]


@pytree_dataclass
class Model:
    embed: f32[b"V/t M/d/c"]
    layers: Array[b"layers", Layer]
    final_norm: f32[b"M"]
    unembed: f32[b"M/d/c V/t"]


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

    # `drawn_as` merges a dimension that no mesh axis splits into its left neighbour: the same
    # values (threefry numbers the elements in row-major order) and the same shard on each
    # device, but XLA:CPU compiles a rank-5 draw several times slower (seconds per array).
    def normal(name, shape, fan_in, drawn_as=None):
        return jax.random.normal(fold_in_str(key, name), drawn_as or shape, jnp.float32).reshape(shape) / math.sqrt(fan_in)

    layers = Layer(
        attn_norm=jnp.ones((n, M)),
        w_q=normal("w_q", (n, M, Q, K, D), M, drawn_as=(n, M * Q, K * D)),
        w_k=normal("w_k", (n, M, K, D), M, drawn_as=(n, M, K * D)),
        w_v=normal("w_v", (n, M, K, D), M, drawn_as=(n, M, K * D)),
        w_o=normal("w_o", (n, Q, K, D, M), Q * K * D, drawn_as=(n * Q, K * D, M)),
        ffn_norm=jnp.ones((n, M)),
        w_gate=normal("w_gate", (n, M, F), M),
        w_up=normal("w_up", (n, M, F), M),
        w_down=normal("w_down", (n, F, M), F),
    )
    return Model(embed=normal("embed", (V, M), 1), layers=layers, final_norm=jnp.ones((M,)), unembed=normal("unembed", (M, V), M))


# ---------------------------------------------------------------------------------------------
# The model. Everything below runs inside shard_map: shapes are per device.


@typechecked
def document_positions(is_seq_start: bool_[b"B/d L"]) -> tuple[u32[b"B/d L"], u32[b"B/d L"]]:
    """(where its document starts, position within the document) of every token of whole rows.
    Positions restart at each document so that a packed document sees the same RoPE phases as
    one generated alone. A row's first tokens belong to a document that started earlier (start
    0) unless is_seq_start says otherwise."""
    index = jnp.arange(is_seq_start.shape[1], dtype=jnp.uint32)
    doc_start = lax.cummax(jnp.where(is_seq_start, index, 0), axis=1)
    return doc_start, index - doc_start


# Context parallelism: a device holds its chunks of every row (`L/c`, in the order of
# data_loader.zigzag_chunks). A token's input, document start and position depend on the tokens
# before it, which may be on other devices: these two functions go to whole rows and back (an
# all-gather over c of a few bytes a token; with c = 1 both are the identity).


def whole_rows(x):
    """[B/d, L/c] (this device's chunks) -> [B/d, L], the rows in order."""
    c = axis_size("c")
    chunks = zigzag_chunks(x.shape[1] * c, c)
    laid_out = all_gather("B/d L/c -> B/d L", x)
    offsets = [sum(stop - start for start, stop in chunks[:i]) for i in range(len(chunks))]
    return jnp.concatenate([laid_out[:, o : o + stop - start] for (start, stop), o in sorted(zip(chunks, offsets))], axis=1)


def this_devices_chunks(x):
    """[B/d, L] whole rows -> [B/d, L/c], the chunks this device holds."""
    c = axis_size("c")
    laid_out = jnp.concatenate([x[:, start:stop] for start, stop in zigzag_chunks(x.shape[1], c)], axis=1)
    return lax.dynamic_slice_in_dim(laid_out, lax.axis_index("c") * (x.shape[1] // c), x.shape[1] // c, axis=1)


def rms_norm(x, weight, eps: float):
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, in float32."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_rotation(position, d_head: int, base: float):
    """(sin, cos) [B, L, R] of the rotary embedding's angles (RoFormer, Su et al. 2021) at
    positions [B, L]: position / base^(2r / D). Computed once a step, outside the layers: inside,
    the backward pass would recompute them for every element of q and k."""
    inverse_timescale = base ** (-jnp.arange(0, d_head, 2, dtype=jnp.float32) / d_head)  # [R]
    angle = position.astype(jnp.float32)[..., None] * inverse_timescale  # [B, L, R]
    return jnp.sin(angle), jnp.cos(angle)


def rope(x, sin, cos):
    """x [B, L, ..., D] float32 rotated by the angles of rope_rotation (sin, cos [B, L, R]), in the
    rotate-half layout: the pairs (r, r + R)."""
    sin, cos = (a.reshape(a.shape[:2] + (1,) * (x.ndim - 3) + a.shape[2:]) for a in (sin, cos))
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def transformer_layer(h: ModelConfig, x, w: Layer, rotation, attend):
    """One block on the residual stream x [B/d, L/c, M/t] (float32): pre-RMSNorm grouped-query
    attention (Ainslie et al. 2023: Q query heads share each of the K kv heads) with RoPE
    (rotation: rope_rotation's sin and cos at the tokens' positions), then
    pre-RMSNorm SwiGLU (Shazeer 2020). `attend(q, k, v) -> (o, extra)` is the attention proper:
    training attends within documents (training_layer); sample.py attends over its KV cache
    and returns the updated cache as `extra`. Returns (x after the block, extra)."""
    nx = all_gather("B/d L/c M/t -> B/d L/c M", x)  # the norm needs all of M
    nx = save_for_backward(rms_norm(nx, w.attn_norm, h.norm_eps).astype(MATMUL_DTYPE))
    # FSDP: gather this layer's weights over d and c, cast to MATMUL_DTYPE before they cross the
    # wire; the gradients come back as float32 reduce-scatters (all_gather_cast's transpose).
    w_q = all_gather_cast("M/d/c Q K/t D -> M Q K/t D", w.w_q, MATMUL_DTYPE)
    w_k = all_gather_cast("M/d/c K/t D -> M K/t D", w.w_k, MATMUL_DTYPE)
    w_v = all_gather_cast("M/d/c K/t D -> M K/t D", w.w_v, MATMUL_DTYPE)
    q = einsum_unreduced("B/d L/c M, M Q K/t D -> B/d L/c Q K/t D", nx, w_q)
    k = einsum_unreduced("B/d S/c M, M K/t D -> B/d S/c K/t D", nx, w_k)
    v = einsum_unreduced("B/d S/c M, M K/t D -> B/d S/c K/t D", nx, w_v).astype(MATMUL_DTYPE)
    q, k = rope(q, *rotation).astype(MATMUL_DTYPE), rope(k, *rotation).astype(MATMUL_DTYPE)
    # Training's attend (attention.ring_attention) keeps q, k, v as head blocks, o and its log-sum-exp for backward.
    o, extra = attend(q, k, v)  # [B/d, L/c, Q, K/t, D]
    w_o = all_gather_cast("Q K/t D M/d/c -> Q K/t D M", w.w_o, MATMUL_DTYPE)
    out = einsum_unreduced("B/d L/c Q K/t D, Q K/t D M -> B/d L/c M", o, w_o)  # partial sums over t
    x = save_for_backward(x + psum_scatter("B/d L/c M -> B/d L/c M/t", out))

    nx = all_gather("B/d L/c M/t -> B/d L/c M", x)
    nx = save_for_backward(rms_norm(nx, w.ffn_norm, h.norm_eps).astype(MATMUL_DTYPE))
    w_gate = all_gather_cast("M/d/c F/t -> M F/t", w.w_gate, MATMUL_DTYPE)
    w_up = all_gather_cast("M/d/c F/t -> M F/t", w.w_up, MATMUL_DTYPE)
    gate = save_for_backward(einsum_unreduced("B/d L/c M, M F/t -> B/d L/c F/t", nx, w_gate).astype(MATMUL_DTYPE))
    up = save_for_backward(einsum_unreduced("B/d L/c M, M F/t -> B/d L/c F/t", nx, w_up).astype(MATMUL_DTYPE))
    # silu(gate) * up in float32, rounded once: in bf16 XLA:CPU rounds after every step of the
    # sigmoid, at twice the cost.
    gate_f32 = gate.astype(jnp.float32)
    hidden = (gate_f32 * jax.nn.sigmoid(gate_f32) * up).astype(MATMUL_DTYPE)
    w_down = all_gather_cast("F/t M/d/c -> F/t M", w.w_down, MATMUL_DTYPE)
    # w_down enters transposed, [M, F/t] (stored [F, M]): XLA:CPU's matmul contracts its left operand
    # on the last dimension, so for a weight's gradient (a sum over tokens) it transposes the
    # token-major operand that gives the gradient's first dimension: here the output gradient
    # [B L, M]; [F, M] transposed hidden [B L, F/t], with SwiGLU's recompute fused into that pass.
    out = einsum_unreduced("B/d L/c F/t, M F/t -> B/d L/c M", hidden, jnp.transpose(w_down))  # partial sums over t
    return x + psum_scatter("B/d L/c M -> B/d L/c M/t", out), extra


@typechecked
def training_layer(h: ModelConfig, x: f32[b"B/d L/c M/t"], w: Layer, doc_start: u32[b"B/d L/c"], sin: f32[b"B/d L/c R"], cos: f32[b"B/d L/c R"],
                   row_position: u32[b"L/c"]) -> f32[b"B/d L/c M/t"]:
    """transformer_layer as training runs it: causal attention within documents, by blocks, over
    the keys of every device of the c ring (row_position: where each token sits in the row)."""
    attend = lambda q, k, v: (ring_attention(q, k, v, doc_start, row_position, h.attention_block), None)  # noqa: E731
    return transformer_layer(h, x, w, (sin, cos), attend)[0]


def embed_tokens(w: Model, inputs):
    """The residual stream [B/d, L/c, M/t] (float32) of input tokens [B/d, L/c]. The table stays
    float32 on the wire: its gradient sums many tokens' rows, which bfloat16 would round badly."""
    embed = all_gather("V/t M/d/c -> V/t M", w.embed)
    return psum_scatter("B/d L/c M -> B/d L/c M/t", index_unreduced("V/t M, B/d L/c -> B/d L/c M", embed, inputs))


def output_logits(h: ModelConfig, w: Model, x):
    """Next-token logits [B/d, L/c, V/t] (float32, this device's slice of V) of the residual stream x [B/d, L/c, M/t]."""
    nx = rms_norm(all_gather("B/d L/c M/t -> B/d L/c M", x), w.final_norm, h.norm_eps).astype(MATMUL_DTYPE)
    unembed = all_gather_cast("M/d/c V/t -> M V/t", w.unembed, MATMUL_DTYPE)
    return einsum_unreduced("B/d L/c M, M V/t -> B/d L/c V/t", nx, unembed)


@typechecked
def forward(h: ModelConfig, w: Model, inputs: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"]) -> f32[b"B/d L/c V/t"]:
    """Next-token logits at every position of packed documents. The input of a document's
    first position is token 0 (begin of document)."""
    length = inputs.shape[1] * axis_size("c")
    check_attention_blocks(h, length, axis_size("c"))
    doc_start, position = (this_devices_chunks(x) for x in document_positions(whole_rows(is_seq_start)))
    row_position = this_devices_chunks(jnp.arange(length, dtype=jnp.uint32)[None, :])[0]
    sin, cos = rope_rotation(position, h.d_head, h.rope_base)
    x = embed_tokens(w, inputs)

    @explicit_activation_checkpointing
    def body(x, layer_weights):
        return training_layer(h, x, layer_weights, doc_start, sin, cos, row_position), None

    x, _ = lax.scan(body, x, w.layers)
    return output_logits(h, w, x)


def model_flops_per_token(h: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of `forward`, counted by hand: 2 FLOPs per multiply-add of every
    matmul of the forward pass, times 3 for forward + backward (the backward does two matmuls
    per forward matmul: one for the input's gradient, one for the weight's). Attention counts
    QK^T and PV over the causal half of the L x L scores, as if masked work were skipped (PaLM,
    Chowdhery et al. 2022, appendix B, counts it the same way). Norms, RoPE, softmax, the
    embedding lookup and the optimizer are left out (under 1% at useful sizes); so is
    recomputation in the backward pass: this is MFU, not HFU."""
    M, Q, K, D, F, V = h.d_model, h.n_q_per_kv, h.n_kv, h.d_head, h.d_ff, h.vocab
    projections = 2 * M * (Q * K * D) + 2 * (2 * M * (K * D)) + 2 * (Q * K * D) * M  # q; k and v; out
    ffn = 3 * (2 * M * F)  # gate, up, down
    attention = 2 * (2 * (Q * K * D) * seq_len) / 2  # QK^T and PV against every key, halved
    forward = h.layers * (projections + ffn + attention) + 2 * M * V  # + the unembedding
    return 3.0 * forward


@typechecked
def model_loss(h: ModelConfig, w: Model, targets: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"], loss_mask: bool_[b"B/d L/c"]) -> f32[b""]:
    """This device's share of the mean next-token cross-entropy over the global batch's real
    tokens (loss_mask is False on padding). Each document's first token is predicted from
    input token 0, so every real token is a target."""
    row_targets, row_starts = whole_rows(targets), whole_rows(is_seq_start)  # a chunk's first input is the end of another chunk
    inputs = this_devices_chunks(jnp.where(row_starts, 0, jnp.pad(row_targets[:, :-1], ((0, 0), (1, 0)))))
    logits = forward(h, w, inputs, is_seq_start)  # float32
    # Cross-entropy over a vocabulary split across t: log-sum-exp and the target's logit each
    # need one sum over t; take_unreduced picks the target's logit on the device holding it.
    max_logit = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), "t")
    sum_exp = psum("B/d L/c", jnp.sum(jnp.exp(logits - max_logit[..., None]), axis=-1), "t")
    target_logit = psum("B/d L/c", take_unreduced("B/d L/c V/t, B/d L/c -> B/d L/c", logits, targets), "t")
    token_losses = max_logit + jnp.log(sum_exp) - target_logit
    global_tokens = lax.psum(jnp.sum(loss_mask, dtype=jnp.float32), ("d", "c"))
    return jnp.sum(jnp.where(loss_mask, token_losses, 0.0)) / jnp.maximum(global_tokens, 1.0)


# ---------------------------------------------------------------------------------------------
# Optimizer: AdamW with bias correction (Kingma & Ba 2015, Alg. 1; Loshchilov & Hutter 2019),
# global-norm clipping, linear warmup then cosine decay.


def learning_rate(training: TrainingConfig, step):
    """Rate used by step `step` (0-based): linear warmup over warmup_steps to the peak, then
    cosine decay to final_learning_rate_fraction of the peak at the last step."""
    step = step.astype(jnp.float32)
    warmup = (step + 1) / max(training.warmup_steps, 1)
    progress = jnp.clip((step - training.warmup_steps) / max(training.steps - 1 - training.warmup_steps, 1), 0.0, 1.0)
    cosine = training.final_learning_rate_fraction + (1 - training.final_learning_rate_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return training.learning_rate * jnp.where(step < training.warmup_steps, warmup, cosine)


def adamw_update(training: TrainingConfig, step, lr, clip_scale, w, g, mu, nu):
    """One AdamW step of one weight array; `clip_scale` scales the gradient first."""
    g = g * clip_scale
    mu = training.adam_b1 * mu + (1 - training.adam_b1) * g
    nu = training.adam_b2 * nu + (1 - training.adam_b2) * g * g
    t = step.astype(jnp.float32) + 1
    mu_hat = mu / (1 - training.adam_b1**t)
    nu_hat = nu / (1 - training.adam_b2**t)
    w = w - lr * (mu_hat / (jnp.sqrt(nu_hat) + training.adam_eps) + training.weight_decay * w)
    return w, mu, nu


def clip_scale(training: TrainingConfig, grad_norm):
    return jnp.minimum(1.0, training.grad_clip / jnp.maximum(grad_norm, 1e-30))


def optimizer_step(training: TrainingConfig, step, weights, grads, adam_mu, adam_nu, grad_norm):
    """AdamW on every leaf. `grad_norm` is the global norm; no other cross-device work."""
    lr = learning_rate(training, step)
    scale = clip_scale(training, grad_norm)
    updated = jax.tree.map(partial(adamw_update, training, step, lr, scale), weights, grads, adam_mu, adam_nu)
    is_triple = lambda x: isinstance(x, tuple)  # noqa: E731
    pick = lambda i: jax.tree.map(lambda u: u[i], updated, is_leaf=is_triple)  # noqa: E731
    return pick(0), pick(1), pick(2), lr


# ---------------------------------------------------------------------------------------------
# The training step: one jitted function, state donated.


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def training_step(state: State, step, targets, is_seq_start, loss_mask, cfg: Config) -> tuple[State, Metrics]:
    weight_specs = make_partition_specs(Model)

    @typed_shard_map
    def step_on_device(
        state: State, step: u32[b""], targets: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"], loss_mask: bool_[b"B/d L/c"]
    ) -> tuple[State, Metrics]:
        loss, grads = jax.value_and_grad(partial(model_loss, cfg.model))(state.weights, targets, is_seq_start, loss_mask)
        loss = lax.psum(loss, ("d", "c"))  # outside autodiff: the gradients are already global
        # Each gradient is sharded as its weight: its squares are summed over the axes that
        # split it, with one all-reduce per distinct set of axes (not one per weight).
        squares_by_axes: dict[tuple[str, ...], list] = {}
        for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(weight_specs, is_leaf=lambda x: isinstance(x, P))):
            squares_by_axes.setdefault(tuple(sorted(spec_axes(spec))), []).append(jnp.sum(g * g))
        grad_norm = jnp.sqrt(sum(lax.psum(sum(parts), axes) if axes else sum(parts) for axes, parts in squares_by_axes.items()))
        weights, mu, nu, lr = optimizer_step(cfg.training, step, state.weights, grads, state.adam_mu, state.adam_nu, grad_norm)
        return State(weights, mu, nu), Metrics(loss, lr, grad_norm)

    return step_on_device(state, step, targets, is_seq_start, loss_mask)


@partial(jax.jit, static_argnames=("cfg",))
def eval_step(weights: Model, targets, is_seq_start, loss_mask, cfg: Config) -> jax.Array:
    """The training loss of one batch (model_loss, the same function), without gradients or update."""

    @typed_shard_map
    def loss_on_device(w: Model, targets: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"], loss_mask: bool_[b"B/d L/c"]) -> f32[b""]:
        return lax.psum(model_loss(cfg.model, w, targets, is_seq_start, loss_mask), ("d", "c"))

    return loss_on_device(weights, targets, is_seq_start, loss_mask)


def init_state(cfg: Config, mesh) -> State:
    @partial(jax.jit, out_shardings=make_shardings(State, mesh))
    def init():
        weights = init_weights(cfg.model, jax.random.key(cfg.training.seed))
        zeros = jax.tree.map(jnp.zeros_like, weights)
        return State(weights, zeros, zeros)

    return init()


def compile_training_step(cfg: Config, state: State, mesh):
    """training_step compiled ahead of time for this state (arrays or ShapeDtypeStructs) and
    batches of the config's shape split over d, as the loader makes them, so that the run reports
    its compile time, FLOPs and memory before the first step; the loop runs it."""
    shape, sharding = (cfg.training.tokens.batch, cfg.training.tokens.len), jax.NamedSharding(mesh, P("d", "c"))
    batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for dtype in (jnp.uint32, jnp.bool_, jnp.bool_)]
    return training_step.lower(state, jnp.uint32(0), *batch, cfg).compile()


def make_mesh(d: int, t: int, c: int = 1, devices=None) -> jax.sharding.Mesh:
    """The (d, c, t) mesh over `devices` (default: all): t innermost (its collectives are the most
    frequent), then the ring c. Auto axes: arrays are placed with the NamedShardings derived from
    their annotations, so no explicit-sharding types are needed."""
    return jax.make_mesh((d, c, t), ("d", "c", "t"), axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


# ---------------------------------------------------------------------------------------------
# The loop. Checkpoint N holds the state after N steps, so resuming from it runs step N next.


def evaluation_batches(cfg: Config, dataset, mesh) -> list:
    """Validation batches 0..eval_batches-1 (none when evaluation is off), read once: every
    evaluation, on any mesh and after any restart, uses these same batches."""
    if not cfg.eval_batches:
        return []
    loader = make_loader(cfg.dataset, dataset, "validation", cfg.training.tokens.batch, cfg.training.tokens.len, mesh)
    try:
        return [loader.batch(i) for i in range(cfg.eval_batches)]
    finally:
        loader.close()


def evaluate(cfg: Config, weights: Model, batches: list) -> float:
    """eval_loss: the mean loss of the validation batches."""
    return float(jnp.mean(jnp.stack([eval_step(weights, b.targets, b.is_seq_start, b.loss_mask, cfg) for b in batches])))


def is_due(interval: int, done: int, steps: int) -> bool:
    """Whether something that runs every `interval` steps (0: only at the end) runs after `done` steps."""
    return done == steps or (interval > 0 and done % interval == 0)


def train(cfg: Config, resolved_yaml: str):
    dataset = open_flat_tokens(cfg.dataset.path)
    validate_config(cfg, jax.device_count(), dataset.max_token_id)
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t, cfg.mesh.c)
    eval_batches = evaluation_batches(cfg, dataset, mesh)
    run_dir = os.path.join(cfg.paths.root_working_dir, cfg.paths.model_name)
    # Everything opened below is closed in reverse order however the run ends (the log flushed,
    # the checkpoint in flight committed, the lock released, the prefetch threads stopped).
    with contextlib.ExitStack() as opened:
        loader = opened.enter_context(contextlib.closing(make_loader(cfg.dataset, dataset, "train", cfg.training.tokens.batch, cfg.training.tokens.len, mesh)))
        opened.enter_context(run_lock.hold(run_dir))  # one writer per run directory, before anything there is read or written
        opened.enter_context(jax.set_mesh(mesh))
        checkpointer = opened.enter_context(contextlib.closing(Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoints)))
        # A checkpoint that does not fit the config stops the run here, before anything but the lock is written.
        restored = checkpointer.restore(jax.eval_shape(lambda: init_state(cfg, mesh)), make_shardings(State, mesh))
        start = restored[0] if restored else 0
        log = opened.enter_context(contextlib.closing(training_io.RunLog(run_dir, resolved_yaml, cfg, start, model_flops_per_token)))
        state = restored[1] if restored else init_state(cfg, mesh)
        # Compile time, FLOPs, optimized HLO, memory and communication reports, before the first step runs.
        step_fn = log.compile(lambda: compile_training_step(cfg, state, mesh))
        log.memory_report(step_fn, state, mesh, partial(training_layer, cfg.model))
        check_step_fits(step_fn, mesh)  # a step that cannot fit stops here, with one line
        log.communication_report(step_fn)  # against communication.predicted_per_step's formula
        # From here SIGTERM asks for a checkpoint after the next step; before, there was no new
        # step to save and it stopped the run at once (multihost.exit_on_sigterm).
        preemption = opened.enter_context(PreemptionWatch())
        for step in range(start, cfg.training.steps):
            batch = loader.batch(step)
            log.before_step(step, state)  # the profiler trace covers two steps after the first
            state, metrics = step_fn(state, jnp.uint32(step), batch.targets, batch.is_seq_start, batch.loss_mask)
            log.after_step(step, metrics)  # logs the step before: reading metrics never stalls the device
            checkpointer.check()  # a failed background write stops training here
            preempted, done = preemption.reached(step), step + 1
            if preempted or is_due(cfg.checkpoint_interval, done, cfg.training.steps):
                log.flush()  # every step a checkpoint holds is logged before it commits
                checkpointer.save(done, state)  # returns after the device-to-host copy
            if eval_batches and is_due(cfg.eval_interval, done, cfg.training.steps):
                log.eval(done, evaluate(cfg, state.weights, eval_batches))
            if preempted:
                print(f"{console_name()}: preempted: checkpoint {done} is being written; exiting", file=sys.stderr, flush=True)
                break
    return state


@hydra.main(config_path="configs", config_name=None, version_base=None)
def main(hydra_cfg: DictConfig):
    exit_on_sigterm()  # one line, not a silent death, until the loop can save instead
    try:
        cfg = config_from_dict(Config, OmegaConf.to_container(hydra_cfg, resolve=True))
        initialize_distributed(cfg.distributed)  # before any other JAX call
        train(cfg, OmegaConf.to_yaml(hydra_cfg, resolve=True))
        leave()  # the other processes' watchdogs take this exit for a finish, not a death
    except SeqaxError as e:
        print(f"{console_name()}: error: {e}", file=sys.stderr, flush=True)
        leave(error=True)  # process 0: the other processes stop with a line first
        sys.exit(2)
    except jax.errors.JaxRuntimeError as e:
        exit_if_peer_lost(e)  # several processes: one line naming the likely cause, then exit
        raise


if __name__ == "__main__":
    main()
