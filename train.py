"""seqax: the model, the loss, the optimizers and the training loop, in one file.

    python -m train --config-name=local_test_synthetic +paths.model_name=RUN [key=value ...]

Dimension names, used the same way in every annotation and spec string:
    B  batch (sequences)             L  positions of queries       S  positions of keys (= L)
    M  d_model                       F  d_ff                       V  vocabulary
    Q  query heads per kv head       K  kv heads                   D  head dimension
    R  RoPE frequencies (D / 2)       E  experts                    H  an expert's d_ff
    N  rows for experts              I  devices of d (senders)
    layers  transformer blocks (weights stacked, run one after another)
Mesh axes: `d` splits the batch and, FSDP-style, the weights (gathered one layer at a time, sent as
MATMUL_DTYPE; their gradients come back reduce-scattered in float32); `t` splits heads, d_ff and
vocabulary (tensor parallelism, Megatron-style) and, between blocks, the residual stream's M
(`B/d L/c M/t`): each block all-gathers it over t before its norm and reduce-scatters its output;
`c` splits every row's positions (context parallelism: each device holds two chunks of each row,
data_loader.zigzag_chunks; attention passes keys and values around the c ring) and, with d, the
weights.

Precision: weights, optimizer state, the residual stream and norms in float32; matmul operands in
MATMUL_DTYPE (bfloat16) with float32 accumulation; every sum across devices in float32.

Names: `cfg` is a run's Config, `h` its model section, `training` its training section (config.py).
"""

import contextlib
import math
import operator
import os
import sys
import typing
from functools import partial

if __name__ == "__main__":  # `python -m train`: a SIGTERM or Ctrl-C during the imports below gets its one line too
    from seqax.signals import exit_on_signal

    exit_on_signal()

import jax
import jax.numpy as jnp
from jax import lax
from omegaconf import DictConfig, OmegaConf

from seqax import run_lock
from seqax.attention import training_attention
from seqax.checkpoint import Checkpointer
from seqax.config import Config, ModelConfig, TrainingConfig, config_from_dict, run_hydra
from seqax.data_loader import make_loader, zigzag_chunks
from seqax.evaluation import Evaluation
from seqax.flat_tokens import open_flat_tokens
from seqax.grouped_swiglu import grouped_swiglu
from seqax.jax_extra import explicit_activation_checkpointing, fold_in_str, save_for_backward
from seqax.memory import check_step_fits
from seqax.multihost import console_name, initialize_distributed, make_mesh, run_program, wait_for_all_processes
from seqax.records import RunRecords, resumed
from seqax.shardlib.shardops import all_gather, all_gather_cast, all_to_all, einsum_unreduced, global_norm
from seqax.shardlib.shardops import index_unreduced, inverse, psum, psum_scatter, ragged_all_to_all, take_unreduced
from seqax.shardlib.shardtypes import Array, Masked, bool_, f32, make_partition_specs, make_shardings, pytree_dataclass
from seqax.shardlib.shardtypes import typechecked, typed_shard_map, u32
from seqax.signals import PreemptionWatch
from seqax.startup_report import StartupReport, compile_step
from seqax.validation import check_attention_blocks, validate_config

# ---------------------------------------------------------------------------------------------
# Operands of every matmul are cast to this type; products accumulate in float32. bfloat16 is the
# fast path on every accelerator; with float32 a step is exact up to the order of sums (the
# model tests use that to check the math against tests/reference.py).
MATMUL_DTYPE = jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# Weights. Every field says its shape and sharding; the optimizers' state has the same types.


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
    # The mixture of experts (model.experts = E > 0; with 0 these are empty and the model is dense).
    router: f32[b"M E"]
    expert_bias: f32[b"E"]  # added to the router's scores to pick experts, not to weigh them: load balance
    expert_gate: f32[b"E/d M/c/t H"]  # expert parallelism: E / d experts a device (routed_experts)
    expert_up: f32[b"E/d M/c/t H"]
    expert_down: f32[b"E/d H M/c/t"]


@pytree_dataclass
class Model:
    embed: f32[b"V/t M/d/c"]
    layers: Array[b"layers", Layer]
    final_norm: f32[b"M"]
    unembed: f32[b"M/d/c V/t"]


@pytree_dataclass
class State:
    weights: Model
    muon_momentum: Masked[Model]  # of the weights MUON names (below); None at the others
    adam_mu: Masked[Model]  # AdamW's moments of every other weight; None at MUON's
    adam_nu: Masked[Model]


@pytree_dataclass
class Metrics:
    loss: f32[b""]
    learning_rate: f32[b""]
    grad_norm: f32[b""]
    expert_load: f32[b""]  # the busiest expert's rows over the mean, in the layer where that is largest (dense: 0)


@pytree_dataclass
class Routing:
    """What one layer's router did with this device's tokens."""

    load: f32[b"E"]  # rows (a token's choice of an expert) each expert got
    balance_loss: f32[b""]  # this device's share of the sequence-wise balance loss (routed_experts)


def init_weights(h: ModelConfig, key: jax.Array) -> Model:
    """Normal weights with std 1/sqrt(fan_in) (embeddings: std 1), norms at 1. Run under jit
    with sharded outputs: each device draws only its shard, and the values do not depend on
    the mesh (threefry is partitionable)."""
    M, Q, K, D, F, V, n = h.d_model, h.n_q_per_kv, h.n_kv, h.d_head, h.d_ff, h.vocab, h.layers
    E, H = h.experts, h.expert_d_ff

    # XLA:CPU only: `drawn_as` draws the same values with unsplit dimensions merged, which XLA:CPU
    # compiles several times faster (docs/performance.md, "Start-up").
    def normal(name, shape, fan_in, drawn_as=None):
        values = jax.random.normal(fold_in_str(key, name), drawn_as or shape, jnp.float32)
        return values.reshape(shape) / math.sqrt(fan_in)

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
        router=normal("router", (n, M, E), M),
        expert_bias=jnp.zeros((n, E)),
        expert_gate=normal("expert_gate", (n, E, M, H), M),
        expert_up=normal("expert_up", (n, E, M, H), M),
        expert_down=normal("expert_down", (n, E, H, M), H),
    )
    return Model(embed=normal("embed", (V, M), 1), layers=layers, final_norm=jnp.ones((M,)),
                 unembed=normal("unembed", (M, V), M))


# ---------------------------------------------------------------------------------------------
# The model. Everything below runs inside shard_map: shapes are per device.


# With context parallelism (c > 1) a device holds two chunks of each row (data_loader.zigzag_chunks),
# but a token's input, document start and position depend on the tokens before it, which may be on
# other devices: these two go to whole rows and back (an all-gather over c of a few bytes a token;
# with c = 1 both are the identity).


def whole_rows(x):
    """[B/d, L/c] (this device's chunks, in the order of zigzag_chunks) -> [B/d, L], the rows in order."""
    c = lax.axis_size("c")
    chunks = zigzag_chunks(x.shape[1] * c, c)
    laid_out = all_gather("B/d L/c -> B/d L", x)
    offsets = [sum(stop - start for start, stop in chunks[:i]) for i in range(len(chunks))]
    pieces = [laid_out[:, o : o + stop - start] for (start, stop), o in sorted(zip(chunks, offsets))]
    return jnp.concatenate(pieces, axis=1)


def this_devices_chunks(x):
    """[B/d, L] whole rows -> [B/d, L/c], the chunks this device holds."""
    c = lax.axis_size("c")
    laid_out = jnp.concatenate([x[:, start:stop] for start, stop in zigzag_chunks(x.shape[1], c)], axis=1)
    return lax.dynamic_slice_in_dim(laid_out, lax.axis_index("c") * (x.shape[1] // c), x.shape[1] // c, axis=1)


@typechecked
def document_positions(is_seq_start: bool_[b"B/d L"]) -> tuple[u32[b"B/d L"], u32[b"B/d L"]]:
    """(where its document starts, position within the document) of every token of whole rows. Positions
    restart at each document, so that a packed document sees the RoPE phases of one generated alone. A row's
    first tokens belong to a document that started earlier (start 0) unless is_seq_start says otherwise."""
    index = jnp.arange(is_seq_start.shape[1], dtype=jnp.uint32)
    doc_start = lax.cummax(jnp.where(is_seq_start, index, 0), axis=1)
    return doc_start, index - doc_start


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


def routed_experts(h: ModelConfig, normed, nx, w: Layer) -> tuple[jax.Array, Routing]:
    """The mixture of experts on the normed stream [B/d, L/c, M], `normed` in float32 and nx its
    MATMUL_DTYPE rounding: its output [B/d, L/c, M] (float32, partial sums over t) and the layer's
    Routing. The router reads `normed`: a choice that a rounding of nx could flip would differ between
    meshes, whose float32 sums differ in their last bits. Each token goes to the experts_per_token
    (k) experts of highest score + expert_bias and returns the sum of their SwiGLUs, weighed by its
    gates: the sigmoids of its router logits at the chosen experts, normalized to sum to 1 (DeepSeek-V3,
    Liu et al. 2024: the bias balances the load by changing who is picked, never a gate's value).

    Expert parallelism over d: device i of d holds experts i E/d .. (i + 1) E/d - 1 (split over c and t
    FSDP-style, gathered a layer at a time), and each row goes to its expert's device and back, a ragged
    all-to-all each way. The t devices of a group hold the same tokens: each sends its share of them, so
    that a row is computed once, whole (all of H), and its output rounded once to MATMUL_DTYPE: the same
    on any mesh. Dropless: every (token, choice) row is computed, whichever device it lands on, by the
    same matmuls. There the rows of each expert are listed in blocks of expert_block rows (padded to whole
    blocks), and grouped_swiglu runs each expert's SwiGLU over its blocks only: a loop whose length is the
    load. Buffers are sized for the worst load (every row of the d devices to one device), the work for
    the real one."""
    B, L, M = nx.shape
    E, k, b = h.experts, h.experts_per_token, h.expert_block
    scores = jax.nn.sigmoid(jnp.einsum("blm,me->ble", normed, w.router))  # float32 [B, L, E]
    _, chosen = lax.top_k(lax.stop_gradient(scores) + w.expert_bias, k)  # [B, L, k]; a tie goes to the lower index
    gates = jnp.take_along_axis(scores, chosen, axis=-1)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    picked = jnp.sum(chosen[..., None] == jnp.arange(E), axis=(1, 2), dtype=jnp.int32)  # [B, E] per sequence
    # Dispatch. This device's share of the group's B L tokens: T of them from `first` (the last share padded
    # past B L with tokens of no expert, E). Row r is token first + r // k's choice r % k; the rows go in
    # expert order to their experts' devices (E / d experts a device), which compute them and send them back.
    d, t, here = lax.axis_size("d"), lax.axis_size("t"), E // lax.axis_size("d")
    T = -(-B * L // t)
    first = lax.axis_index("t") * T

    def share(x, fill):  # this device's T tokens of x [B, L, k], padded with `fill`
        padded = jnp.pad(x.reshape(B * L, k), ((0, T * t - B * L), (0, 0)), constant_values=fill)
        return lax.dynamic_slice_in_dim(padded, first, T)

    expert = share(chosen, E).reshape(-1)
    N = expert.size
    one_hot = expert[:, None] == jnp.arange(E + 1)  # [N, E + 1]: padding rows in the last column
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0, dtype=jnp.int32), expert[:, None], axis=1)[:, 0] - 1
    count = jnp.sum(one_hot, axis=0, dtype=jnp.int32)
    position = (jnp.cumsum(count) - count)[expert] + rank  # each row's place in expert order (padding last)
    in_order = jnp.zeros(N, jnp.int32).at[position].set(jnp.arange(N, dtype=jnp.int32))
    sizes = jnp.sum(count[:E].reshape(d, here), axis=1)  # rows for each device of d (padding rows unsent)
    rows = nx.reshape(B * L, M).at[first + in_order // k].get(mode="clip")  # (a padding row reads some token)
    received = ragged_all_to_all("N M -> d N M", rows, sizes)  # slot s: device s's rows
    # Here, slot s holds first sent[s, 0] rows of this device's first expert, then sent[s, 1] of its second...
    sent = all_to_all("I/d E -> I E/d", count[None, :E])  # [d, here]: rows each device sent to each expert here
    i, ends_in_slot = jnp.arange(N), jnp.cumsum(sent, axis=1)
    local = jnp.minimum(jnp.sum(i[:, None] >= ends_in_slot[:, None], axis=2), here - 1)  # [d, N]: each row's expert
    # A row's place among its expert's rows: those from the devices before its sender's, then its own.
    place = (jnp.cumsum(sent, axis=0) - ends_in_slot)[jnp.arange(d)[:, None], local] + i
    # The rows of each expert here listed in blocks of b, padded to whole blocks: enough blocks for any load.
    blocks = -(-jnp.sum(sent, axis=0) // b)
    ends = jnp.cumsum(blocks)
    n = (d * N + here * (b - 1)) // b
    slot = jnp.where(i < jnp.sum(sent, axis=1)[:, None], (ends - blocks)[local] * b + place, n * b)  # [d, N]
    listed = jnp.full(n * b, d * N, jnp.int32).at[slot.reshape(-1)].set(jnp.arange(d * N), mode="drop")
    expected = -(-(N // max(here, 1) + b // 2) // b)  # an expert's blocks at a balanced load, half a block padding
    # The experts here, whole: gathered over c and t (FSDP) and cast.
    gate_w = all_gather_cast("E/d M/c/t H -> E/d M H", w.expert_gate, MATMUL_DTYPE)
    up_w = all_gather_cast("E/d M/c/t H -> E/d M H", w.expert_up, MATMUL_DTYPE)
    down_w = all_gather_cast("E/d H M/c/t -> E/d H M", w.expert_down, MATMUL_DTYPE)
    # Each block's SwiGLU (silu(x gate_w) * x up_w) down_w by its expert's weights, as the dense one's math,
    # rounded to MATMUL_DTYPE and written over the received rows (no second buffer of d N rows).
    out = grouped_swiglu(received.reshape(d * N, M), listed.reshape(n, b), gate_w, up_w, down_w, ends, expected)
    # Back here, in row order; kept for backward (N rows, not the d N of the buffers), else recomputed.
    out = save_for_backward(ragged_all_to_all("d N M -> N M", out.reshape(d, N, M), sizes)[position])
    out = jnp.einsum("tkm,tk->tm", out.reshape(T, k, M), share(gates, 0.0))  # combine, in float32
    # Into the group's B L tokens, zeros in the others' shares: partial sums over t, as the dense SwiGLU's.
    out = lax.dynamic_update_slice_in_dim(jnp.zeros((T * t, M), jnp.float32), out, first, 0)[:B * L]
    # The sequence-wise balance loss (DeepSeek-V3, eq. 17-20) of each row: sum_i f_i P_i, f_i = E / k x the
    # fraction of the row's choices that picked expert i (whole rows: a sum over c), P_i = expert i's mean
    # score, normalized over experts. Linear in P: each device adds its positions' share. Mean over rows.
    row_length = L * lax.axis_size("c")
    f = lax.psum(picked.astype(jnp.float32), "c") * (jnp.float32(E) / (k * row_length))  # (no experts: empty)
    P = jnp.sum(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1) / row_length
    # The t devices of a group hold the same value: their mean is the value, invariant over t. (Were
    # it added to the loss on each t device, autodiff would count it, and the cross-entropy, t times.)
    balance_loss = lax.pmean(jnp.sum(lax.stop_gradient(f) * P), "t") / (B * lax.axis_size("d"))
    return out.reshape(B, L, M), Routing(jnp.sum(picked, axis=0).astype(jnp.float32), balance_loss)


def transformer_layer(h: ModelConfig, x, w: Layer, rotation, attend):
    """One block on the residual stream x [B/d, L/c, M/t] (float32): pre-RMSNorm grouped-query attention
    (Ainslie et al. 2023: Q query heads share each of the K kv heads) with RoPE (rotation: rope_rotation's
    sin and cos), then pre-RMSNorm SwiGLU (Shazeer 2020) plus the mixture of experts (routed_experts;
    nothing when model.experts is 0). `attend(q, k, v) -> (o, extra)` is the attention proper: training
    attends within documents (training_layer); sample.py attends over its KV cache and returns the
    updated cache as `extra`. Returns (x after the block, extra, Routing)."""
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
    # Training's attend (attention.training_attention's kernel) keeps q, k, v, o and its log-sum-exp for backward.
    o, extra = attend(q, k, v)  # [B/d, L/c, Q, K/t, D]
    w_o = all_gather_cast("Q K/t D M/d/c -> Q K/t D M", w.w_o, MATMUL_DTYPE)
    out = einsum_unreduced("B/d L/c Q K/t D, Q K/t D M -> B/d L/c M", o, w_o)  # partial sums over t
    x = save_for_backward(x + psum_scatter("B/d L/c M -> B/d L/c M/t", out))

    normed = rms_norm(all_gather("B/d L/c M/t -> B/d L/c M", x), w.ffn_norm, h.norm_eps)  # float32
    nx = save_for_backward(normed.astype(MATMUL_DTYPE))
    w_gate = all_gather_cast("M/d/c F/t -> M F/t", w.w_gate, MATMUL_DTYPE)
    w_up = all_gather_cast("M/d/c F/t -> M F/t", w.w_up, MATMUL_DTYPE)
    gate = save_for_backward(einsum_unreduced("B/d L/c M, M F/t -> B/d L/c F/t", nx, w_gate).astype(MATMUL_DTYPE))
    up = save_for_backward(einsum_unreduced("B/d L/c M, M F/t -> B/d L/c F/t", nx, w_up).astype(MATMUL_DTYPE))
    # XLA:CPU only: silu(gate) * up in float32, rounded once (faster there than bf16; docs/performance.md).
    gate_f32 = gate.astype(jnp.float32)
    hidden = (gate_f32 * jax.nn.sigmoid(gate_f32) * up).astype(MATMUL_DTYPE)
    w_down = all_gather_cast("F/t M/d/c -> F/t M", w.w_down, MATMUL_DTYPE)
    # XLA:CPU only: w_down enters transposed, [M, F/t] (stored [F, M]), so that XLA:CPU's weight
    # gradient transposes the output gradient, not hidden (docs/performance.md, "w_down").
    out = einsum_unreduced("B/d L/c F/t, M F/t -> B/d L/c M", hidden, jnp.transpose(w_down))  # partial sums over t
    experts_out, routing = routed_experts(h, normed, nx, w)
    return x + psum_scatter("B/d L/c M -> B/d L/c M/t", out + experts_out), extra, routing


@typechecked
def training_layer(h: ModelConfig, x: f32[b"B/d L/c M/t"], w: Layer, doc_start: u32[b"B/d L/c"],
                   sin: f32[b"B/d L/c R"], cos: f32[b"B/d L/c R"],
                   row_position: u32[b"L/c"]) -> tuple[f32[b"B/d L/c M/t"], Routing]:
    """transformer_layer as training runs it: causal attention within documents, by blocks, over
    the keys of every device of the c ring (row_position: where each token sits in the row), by the
    kernel model.attention_kernel names: "auto" is the fast one for the mesh's platform (Pallas on GPUs
    and TPUs, blockwise on CPUs); "reference" is the readable one whose gradient is autodiff's (README)."""
    attention = training_attention(h.attention_kernel)

    def attend(q, k, v):
        return attention(q, k, v, doc_start, row_position, h.attention_block), None

    x, _, routing = transformer_layer(h, x, w, (sin, cos), attend)
    return x, routing


def embed_tokens(w: Model, inputs):
    """The residual stream [B/d, L/c, M/t] (float32) of input tokens [B/d, L/c]. The table stays
    float32 on the wire: its gradient sums many tokens' rows, which bfloat16 would round badly."""
    embed = all_gather("V/t M/d/c -> V/t M", w.embed)
    return psum_scatter("B/d L/c M -> B/d L/c M/t", index_unreduced("V/t M, B/d L/c -> B/d L/c M", embed, inputs))


def output_logits(h: ModelConfig, w: Model, x):
    """Next-token logits [B/d, L/c, V/t] (float32, this device's slice of V) of the residual stream x."""
    nx = rms_norm(all_gather("B/d L/c M/t -> B/d L/c M", x), w.final_norm, h.norm_eps).astype(MATMUL_DTYPE)
    unembed = all_gather_cast("M/d/c V/t -> M V/t", w.unembed, MATMUL_DTYPE)
    return einsum_unreduced("B/d L/c M, M V/t -> B/d L/c V/t", nx, unembed)


@typechecked
def forward(h: ModelConfig, w: Model, inputs: u32[b"B/d L/c"],
            is_seq_start: bool_[b"B/d L/c"]) -> tuple[f32[b"B/d L/c V/t"], Array[b"layers", Routing]]:
    """Next-token logits at every position of packed documents, and each layer's Routing (stacked).
    The input of a document's first position is token 0 (begin of document)."""
    length = inputs.shape[1] * lax.axis_size("c")
    check_attention_blocks(h, length, lax.axis_size("c"))
    # With c > 1 a token's document start and position depend on other devices' chunks: whole rows and back.
    doc_start, position = (this_devices_chunks(x) for x in document_positions(whole_rows(is_seq_start)))
    row_position = this_devices_chunks(jnp.arange(length, dtype=jnp.uint32)[None, :])[0]
    sin, cos = rope_rotation(position, h.d_head, h.rope_base)
    x = embed_tokens(w, inputs)

    @explicit_activation_checkpointing
    def body(x, layer_weights):
        return training_layer(h, x, layer_weights, doc_start, sin, cos, row_position)

    # A Python loop, not lax.scan: a scan copies every value saved for backward into a [layers, ...]
    # stack and back out: 11-12% of a 1B step on an H200 (docs/performance.md). Compile time grows with layers.
    routings = []
    for i in range(h.layers):
        x, routing = body(x, jax.tree.map(operator.itemgetter(i), w.layers))  # layer i's weights
        routings.append(routing)
    return output_logits(h, w, x), jax.tree.map(lambda *layers: jnp.stack(layers), *routings)


def model_flops_per_token(h: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (MFU's numerator), from the weights' shapes: 2 per multiply-add of every
    matrix a token goes through (the layers' weights of 2 or more dimensions, of the experts only the
    experts_per_token of `experts` a token goes to, the unembedding; the embedding is a lookup), plus
    attention's QK^T and PV over the causal half of the L x L scores (PaLM, app. B); x 3 for forward +
    backward. Norms, RoPE, softmax, routing, the optimizer, recomputation: left out (MFU, not HFU)."""
    w = jax.eval_shape(lambda: init_weights(h, jax.random.key(0)))
    experts = sum(x.size for x in (w.layers.expert_gate, w.layers.expert_up, w.layers.expert_down))
    active = experts * h.experts_per_token // max(h.experts, 1)  # active parameters only
    matrices = sum(x.size for x in jax.tree.leaves(w.layers) if x.ndim > 2) - experts + active + w.unembed.size
    layers, _, *heads = w.layers.w_q.shape  # heads: Q K D
    attention = layers * 2 * (2 * math.prod(heads) * seq_len) / 2  # QK^T and PV against every key, halved
    return 3.0 * (2 * matrices + attention)


@typechecked
def token_losses(h: ModelConfig, w: Model, targets: u32[b"B/d L/c"],
                 is_seq_start: bool_[b"B/d L/c"]) -> tuple[f32[b"B/d L/c"], Array[b"layers", Routing]]:
    """The next-token cross-entropy of every target of packed documents: -log p(target), and each
    layer's Routing. Each document's first token is predicted from input token 0, so every token of
    it is a target."""
    # The inputs are the targets shifted right by one position: the model at position i sees token
    # i - 1 and predicts token i. At a document's first position the input is token 0 (begin of
    # document), not the previous document's last token. The shift is done on whole rows: with
    # c > 1 the input of a chunk's first position is the last target of another device's chunk.
    row_targets, row_starts = whole_rows(targets), whole_rows(is_seq_start)
    shifted = jnp.pad(row_targets[:, :-1], ((0, 0), (1, 0)))  # [B/d, L]: position i holds target i - 1
    inputs = this_devices_chunks(jnp.where(row_starts, 0, shifted))
    logits, routing = forward(h, w, inputs, is_seq_start)  # float32
    # Cross-entropy over a vocabulary split across t: log-sum-exp and the target's logit each
    # need one sum over t; take_unreduced picks the target's logit on the device holding it.
    max_logit = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), "t")
    sum_exp = psum("B/d L/c", jnp.sum(jnp.exp(logits - max_logit[..., None]), axis=-1), "t")
    target_logit = psum("B/d L/c", take_unreduced("B/d L/c V/t, B/d L/c -> B/d L/c", logits, targets), "t")
    return max_logit + jnp.log(sum_exp) - target_logit, routing


def model_loss(h: ModelConfig, balance_weight: float, w: Model, targets, is_seq_start, loss_mask):
    """This device's share of what training minimizes: the mean token_losses over the global batch's real
    tokens (not padding: loss_mask), plus balance_weight x the layers' balance losses. Also returns the
    cross-entropy share alone and the experts' loads [layers, E] (aux)."""
    global_tokens = lax.psum(jnp.sum(loss_mask, dtype=jnp.float32), ("d", "c"))
    losses, routing = token_losses(h, w, targets, is_seq_start)
    loss = jnp.sum(jnp.where(loss_mask, losses, 0.0)) / jnp.maximum(global_tokens, 1)
    return loss + balance_weight * jnp.sum(routing.balance_loss), (loss, routing.load)


# ---------------------------------------------------------------------------------------------
# Optimizers: Muon (Jordan et al. 2024, as modded-nanogpt defines it) for the Layer weights MUON
# names, AdamW (Loshchilov & Hutter 2019; Kingma & Ba 2015's bias correction) for all others
# (`MUON = {}`: AdamW alone). Both take the gradient clipped to a global norm, decay weights
# decoupled and follow one schedule. Each entry: the spec that spreads the stacked layers over all
# devices, each then holding whole matrices (its inverse brings them back), and how many of the last
# dimensions are the matrix's rows and its columns (those before are a stack of matrices: an expert each).
MUON = {
    "w_q": ("layers M/d/c Q K/t D -> layers/d/c/t M Q K D", (1, 3)),  # [M, Q K D]
    "w_k": ("layers M/d/c K/t D -> layers/d/c/t M K D", (1, 2)),
    "w_v": ("layers M/d/c K/t D -> layers/d/c/t M K D", (1, 2)),
    "w_o": ("layers Q K/t D M/d/c -> layers/d/c/t Q K D M", (3, 1)),  # [Q K D, M]
    "w_gate": ("layers M/d/c F/t -> layers/d/c/t M F", (1, 1)),
    "w_up": ("layers M/d/c F/t -> layers/d/c/t M F", (1, 1)),
    "w_down": ("layers F/t M/d/c -> layers/d/c/t F M", (1, 1)),
    "expert_gate": ("layers E/d M/c/t H -> layers/d/c/t E M H", (1, 1)),  # E matrices [M, H] a layer
    "expert_up": ("layers E/d M/c/t H -> layers/d/c/t E M H", (1, 1)),
    "expert_down": ("layers E/d H M/c/t -> layers/d/c/t E H M", (1, 1)),
}
NEWTON_SCHULZ_STEPS = 5


def schedule(training: TrainingConfig, step):
    """The fraction of the peak learning rates that step `step` (0-based) uses: linear warmup over
    warmup_steps, then cosine decay to final_learning_rate_fraction at the last step."""
    step, final = step.astype(jnp.float32), training.final_learning_rate_fraction
    warmup = (step + 1) / max(training.warmup_steps, 1)
    progress = jnp.clip((step - training.warmup_steps) / max(training.steps - 1 - training.warmup_steps, 1), 0.0, 1.0)
    return jnp.where(step < training.warmup_steps, warmup, final + (1 - final) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))


def adamw_update(training: TrainingConfig, step, lr, w, g, mu, nu):
    """One AdamW step of one weight array."""
    mu = training.adam_b1 * mu + (1 - training.adam_b1) * g
    nu = training.adam_b2 * nu + (1 - training.adam_b2) * g * g
    t = step.astype(jnp.float32) + 1
    mu_hat, nu_hat = mu / (1 - training.adam_b1**t), nu / (1 - training.adam_b2**t)
    return w - lr * (mu_hat / (jnp.sqrt(nu_hat) + training.adam_eps) + training.weight_decay * w), mu, nu


def newton_schulz(G):
    """U V^T of each matrix G = U S V^T [..., rows, cols] (rows <= cols), approximately: X <- aX +
    (bA + cA^2)X with A = X X^T (the smaller Gram matrix), from X = G / ||G|| (every singular value at
    most 1), whose coefficients Jordan et al. 2024 chose to bring singular values to about [0.7, 1.2]
    fast. A stack of matrices goes as batched matmuls: a few large kernels, not many small ones.
    Operands in MATMUL_DTYPE, sums in float32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    mm = partial(jnp.einsum, preferred_element_type=jnp.float32)
    X = G.astype(jnp.float32)
    X = X / (jnp.sqrt(jnp.sum(X * X, axis=(-2, -1), keepdims=True)) + 1e-7)
    for _ in range(NEWTON_SCHULZ_STEPS):
        X_ = X.astype(MATMUL_DTYPE)
        A = mm("...ik,...jk->...ij", X_, X_)  # X X^T, contracting both on their last dimension: no transposed copy
        B = b * A + c * mm("...ij,...jk->...ik", A.astype(MATMUL_DTYPE), A.astype(MATMUL_DTYPE))
        X = a * X + mm("...ij,...jk->...ik", B.astype(MATMUL_DTYPE), X_)
    return X


def muon_update(training: TrainingConfig, lr, w, g, momentum, spread: str, matrix: tuple[int, int]):
    """One Muon step of a stacked layer weight w [layers, ...]: Nesterov momentum, then each layer's
    matrices (`matrix`: how many of the last dimensions are rows and columns) orthogonalized by the
    device that holds them whole, scaled by sqrt(max(1, fan_out / fan_in))
    (modded-nanogpt's max(1, rows / cols) of torch's [out, in] layout); decoupled weight decay."""
    beta, layers = training.muon_momentum, w.shape[0]
    momentum = beta * momentum + (1 - beta) * g
    g = (1 - beta) * g + beta * momentum  # Nesterov: the gradient, then the momentum it leads to
    devices = lax.axis_size(("d", "c", "t"))
    padded = jnp.pad(g.astype(MATMUL_DTYPE), [(0, -layers % devices)] + [(0, 0)] * (g.ndim - 1))
    whole = all_to_all(spread, padded)  # [layers / devices, ...]: this device's matrices, whole
    rows, cols = matrix
    fan_in, fan_out = math.prod(whole.shape[-rows - cols : -cols]), math.prod(whole.shape[-cols:])
    matrices = whole.reshape(math.prod(whole.shape[: -rows - cols]), fan_in, fan_out)

    def wide(x):  # newton_schulz takes rows <= cols: a tall matrix goes as its transpose
        # XLA:CPU only: the barrier materializes the transpose, which XLA:CPU would otherwise fold
        # into a batched bf16 matmul that its runtime cannot run (DotThunk: "BF16 x BF16 = F32").
        return lax.optimization_barrier(jnp.swapaxes(x, 1, 2)) if fan_in > fan_out else x

    def skip(matrices):
        return jnp.zeros_like(matrices, jnp.float32)

    first = lax.axis_index(("d", "c", "t")) * whole.shape[0]  # a device that holds padding only skips the work
    update = wide(lax.cond(first < layers, newton_schulz, skip, wide(matrices)).astype(MATMUL_DTYPE))
    update = all_to_all(inverse(spread), update.reshape(whole.shape))  # back to the weight's sharding
    scale = math.sqrt(max(1.0, fan_out / max(fan_in, 1)))  # (fan_in 0: the empty experts of a dense model)
    w = w - lr * (scale * update[:layers].astype(jnp.float32) + training.muon_weight_decay * w)
    return w, momentum


def newton_schulz_flops(h: ModelConfig, devices: int) -> tuple[float, float]:
    """FLOPs of a step's Newton-Schulz iterations, in all and on the busiest of `devices` (the
    layers spread as muon_update spreads them): per matrix, wide as r x c, each step multiplies
    X X^T (2 r^2 c), A A (2 r^3) and B X (2 r^2 c)."""
    w = jax.eval_shape(lambda: init_weights(h, jax.random.key(0))).layers
    per_layer = 0
    for name, (_, (rows, cols)) in MUON.items():
        shape = getattr(w, name).shape[1:]
        r, c = sorted((math.prod(shape[-rows - cols : -cols]), math.prod(shape[-cols:])))
        per_layer += NEWTON_SCHULZ_STEPS * math.prod(shape[: -rows - cols]) * (4 * r * r * c + 2 * r**3)
    return h.layers * per_layer, -(-h.layers // devices) * per_layer


class Update(typing.NamedTuple):
    """One weight's new value and its optimizer's new state: Muon's momentum, or AdamW's moments."""

    weight: jax.Array
    momentum: jax.Array | None
    mu: jax.Array | None
    nu: jax.Array | None


def optimizer_of(path) -> str:
    """Which rule updates a weight: "muon" (those MUON names), "balance" (the experts' selection bias,
    which no gradient reaches: it follows their load) or "adamw" (all others)."""
    name = path[-1].name
    return "muon" if name in MUON else "balance" if name == "expert_bias" else "adamw"


def balance_update(training: TrainingConfig, bias, load):
    """DeepSeek-V3's auxiliary-loss-free load balance: each expert's bias [layers, E] moves by
    expert_bias_rate towards the mean load of its layer (up if it got fewer rows, down if more)."""
    return bias + training.expert_bias_rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def optimizer_step(training: TrainingConfig, step, state: State, grads: Model, grad_norm,
                   load) -> tuple[State, jax.Array]:
    """Muon on the weights MUON names, AdamW on the rest, from the gradients clipped to the global
    norm `grad_norm`; the experts' bias by their load [layers, E] of this step's batch. Returns the
    new state and AdamW's learning rate."""
    fraction = schedule(training, step)
    muon_lr, adamw_lr = training.muon_learning_rate * fraction, training.learning_rate * fraction
    clip = jnp.minimum(1.0, training.grad_clip / jnp.maximum(grad_norm, 1e-30))

    def update(path, w, g, momentum, mu, nu) -> Update:  # the state holds momentum or moments, None for the other
        rule = optimizer_of(path)
        if rule == "muon":
            w, momentum = muon_update(training, muon_lr, w, g * clip, momentum, *MUON[path[-1].name])
        elif rule == "balance":
            w = balance_update(training, w, load)
        else:
            w, mu, nu = adamw_update(training, step, adamw_lr, w, g * clip, mu, nu)
        return Update(w, momentum, mu, nu)

    updates = jax.tree_util.tree_map_with_path(update, state.weights, grads, state.muon_momentum, state.adam_mu,
                                               state.adam_nu)  # a Model with an Update at every weight

    def field(name):  # one field of every Update, as a Model (None where that optimizer has no state)
        return jax.tree.map(lambda u: getattr(u, name), updates, is_leaf=lambda x: isinstance(x, Update))

    return State(field("weight"), field("momentum"), field("mu"), field("nu")), adamw_lr


# ---------------------------------------------------------------------------------------------
# The training step: one jitted function, state donated.


# The new state is laid out as its annotation says, stated here: XLA would lay out an empty array (the
# experts of a dense model) as it likes, and the next step, compiled for the annotated layout, refuse it.
@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",),
         out_shardings=(make_partition_specs(State), make_partition_specs(Metrics)))
def training_step(state: State, step, targets, is_seq_start, loss_mask, cfg: Config) -> tuple[State, Metrics]:
    @typed_shard_map
    def step_on_device(state: State, step: u32[b""], targets: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"],
                       loss_mask: bool_[b"B/d L/c"]) -> tuple[State, Metrics]:
        loss_and_grad = jax.value_and_grad(partial(model_loss, cfg.model, cfg.training.expert_balance_loss),
                                           has_aux=True)
        (_, (loss, load)), grads = loss_and_grad(state.weights, targets, is_seq_start, loss_mask)
        # Each device differentiates its own share of the loss (its rows and positions): the sum over
        # devices of the gradients happens in the weights' gathers, whose transpose is a reduce-scatter.
        # Only the reported loss and the experts' load need the total, so they are summed here, outside autodiff.
        # (The t devices of a group route the same tokens: their load is counted once.)
        loss, load = lax.psum(loss, ("d", "c")), lax.psum(load, ("d", "c", "t")) / lax.axis_size("t")
        grad_norm = global_norm(grads, Model)  # each gradient is sharded as its weight
        state, lr = optimizer_step(cfg.training, step, state, grads, grad_norm, load)
        busiest = jnp.max(load / jnp.mean(load, axis=-1, keepdims=True), initial=0.0)
        return state, Metrics(loss, lr, grad_norm, busiest)

    return step_on_device(state, step, targets, is_seq_start, loss_mask)


@partial(jax.jit, static_argnames=("cfg",))
def eval_step(weights: Model, targets, is_seq_start, cfg: Config) -> jax.Array:
    """token_losses of one batch [B, L], laid out as the batch: what eval_loss and the tasks read (evaluation.py)."""
    @typed_shard_map
    def on_device(weights: Model, targets: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"]) -> f32[b"B/d L/c"]:
        return token_losses(cfg.model, weights, targets, is_seq_start)[0]

    return on_device(weights, targets, is_seq_start)


def fresh_state(weights: Model) -> State:
    """`weights`, with Muon's momentum of the weights MUON names and AdamW's moments of AdamW's at zero."""
    def zeros(rule: str):  # a Masked[Model]: zeros at the weights `rule` updates, None at the others
        return jax.tree_util.tree_map_with_path(
            lambda path, w: jnp.zeros_like(w) if optimizer_of(path) == rule else None, weights)

    return State(weights, zeros("muon"), zeros("adamw"), zeros("adamw"))


def init_state(cfg: Config, mesh) -> State:
    init = partial(init_weights, cfg.model, jax.random.key(cfg.training.seed))
    return jax.jit(lambda: fresh_state(init()), out_shardings=make_shardings(State, mesh))()


# ---------------------------------------------------------------------------------------------
# The loop. Checkpoint N holds the state after N steps, so resuming from it runs step N next.


def is_due(interval: int, done: int, steps: int) -> bool:
    """Whether something that runs every `interval` steps (0: only at the end) runs after `done` steps."""
    return done == steps or (interval > 0 and done % interval == 0)


def train(cfg: Config, resolved_yaml: str):
    dataset = open_flat_tokens(cfg.dataset.path)
    validate_config(cfg, jax.device_count(), dataset.max_token_id, Model)
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t, cfg.mesh.c)
    evaluation = Evaluation(cfg, dataset, mesh)  # a task file that does not fit stops the run here, with one line
    run_dir = os.path.join(cfg.paths.root_working_dir, cfg.paths.model_name)
    tokens = (cfg.training.tokens.batch, cfg.training.tokens.len)
    # Everything opened below is closed in reverse order however the run ends (the log flushed,
    # the checkpoint in flight committed, the lock released, the prefetch threads stopped).
    with contextlib.ExitStack() as opened:
        loader = opened.enter_context(contextlib.closing(make_loader(cfg.dataset, dataset, "train", *tokens, mesh)))
        opened.enter_context(run_lock.hold(run_dir))  # one writer per run directory, before anything there is touched
        opened.enter_context(jax.set_mesh(mesh))
        checkpointer = opened.enter_context(contextlib.closing(
            Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoints)))
        # A checkpoint that does not fit the state stops the run here, before anything but the lock is written.
        shapes = jax.eval_shape(lambda: init_state(cfg, mesh))
        restored = checkpointer.restore(shapes, make_shardings(State, mesh))
        start = restored[0] if restored else 0
        due = [done for done in checkpointer.complete_steps()
               if evaluation and is_due(cfg.eval_interval, done, cfg.training.steps)]
        if restored and resumed(run_dir, checkpointer.step_dir(start), start, cfg.training.steps, due):
            return restored[1]  # nothing to do: not even a compile
        records = opened.enter_context(RunRecords(
            run_dir, resolved_yaml, cfg, start, model_flops_per_token(cfg.model, cfg.training.tokens.len)))
        state = restored[1] if restored else init_state(cfg, mesh)
        # Compile time, FLOPs, optimized HLO, memory and communication reports, before the first step runs.
        report = opened.enter_context(contextlib.closing(StartupReport(run_dir, cfg)))
        step_fn = report.compile(lambda: compile_step(training_step, cfg, state, mesh), model_flops_per_token,
                                 newton_schulz_flops)
        report.memory_report(step_fn, state, mesh, partial(training_layer, cfg.model), forward, MUON)
        check_step_fits(step_fn, mesh)  # a step that cannot fit stops here, with one line
        report.communication_report(step_fn)
        records.print(evaluation.plan(cfg.eval_interval, cfg.training.steps) if evaluation else "no evaluation")
        wait_for_all_processes("first_step", cfg.distributed.initialization_timeout_seconds)  # process 0 wrote reports
        # An evaluation due at a committed checkpoint's step that a kill or a stop left undone runs now, once.
        for done in records.missing_evaluations(due):
            weights = state.weights if done == start else checkpointer.read(
                done, {"weights": shapes.weights}, {"weights": make_shardings(Model, mesh)})["weights"]
            records.eval(done, evaluation, partial(eval_step, weights, cfg=cfg))
        # From here SIGTERM or Ctrl-C asks for a checkpoint after the next step; before, there was no
        # new step to save and it stopped the run at once (signals.exit_on_signal).
        preemption = opened.enter_context(PreemptionWatch())
        for step in range(start, cfg.training.steps):
            batch = loader.batch(step)
            records.before_step(step, state)  # the profiler's trace covers two steps after the first
            state, metrics = step_fn(state, jnp.uint32(step), batch.targets, batch.is_seq_start, batch.loss_mask)
            records.after_step(step, metrics)  # logs the step before: reading metrics never stalls the device
            checkpointer.check()  # a failed background write stops training here
            preempted, done = preemption.reached(step), step + 1
            if preempted:
                print(f"{console_name()}: {preemption.why()}: checkpoint {done} is being written; exiting",
                      file=sys.stderr, flush=True)
            if preempted or is_due(cfg.checkpoint_interval, done, cfg.training.steps):
                records.flush()  # every step a checkpoint holds is logged before it commits
                checkpointer.save(done, state)  # returns after the device-to-host copy
            if evaluation and is_due(cfg.eval_interval, done, cfg.training.steps) and not preempted:  # else on resume
                records.eval(done, evaluation, partial(eval_step, state.weights, cfg=cfg))
            if preempted:
                break
    return state


def main():
    """`python -m train --config-name=NAME [key=value ...]`: hydra's command line (config.run_hydra)."""
    def program(hydra_cfg: DictConfig):
        cfg = config_from_dict(Config, OmegaConf.to_container(hydra_cfg, resolve=True))
        initialize_distributed(cfg.distributed)  # before any other JAX call
        train(cfg, OmegaConf.to_yaml(hydra_cfg, resolve=True))

    run_program(lambda: run_hydra(program))


if __name__ == "__main__":
    main()
