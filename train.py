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
the matmul type; their gradients come back reduce-scattered in float32); `t` splits heads, d_ff and
vocabulary (tensor parallelism, Megatron-style) and, between blocks, the residual stream's M
(`B/d L/c M/t`): each block all-gathers it over t before its norm and reduce-scatters its output;
`c` splits every row's positions (context parallelism: each device holds two chunks of each row,
data_loader.zigzag_chunks; attention passes keys and values around the c ring) and, with d, the
weights.

Precision: weights, optimizer state, the residual stream and norms in float32; matmuls multiply in
model.matmul_dtype (bfloat16; float8 for the linear layers and the unembedding, each operand scaled by
its amax or a bound on it, the rest in bfloat16; float32 where a test checks the math against
tests/reference.py) with float32 accumulation; every sum across devices in float32.

Names: `cfg` is a run's Config, `arch` its model section (the architecture), `training` its training
section (config.py); `w` weights, `x` the residual stream, `nx` its normed value as matmul operand.
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
from seqax.analysis import flops
from seqax.analysis.memory import check_step_fits
from seqax.analysis.startup_report import StartupReport, compile_step
from seqax.checkpoint import Checkpointer
from seqax.config import Config, ModelConfig, TrainingConfig, config_from_dict, run_hydra
from seqax.data.data_loader import make_loader, zigzag_chunks
from seqax.data.evaluation import Evaluation
from seqax.data.flat_tokens import open_flat_tokens
from seqax.expert_dispatch import plan_dispatch, received_blocks
from seqax.jax_extra import explicit_activation_checkpointing, fold_in_str, save_for_backward
from seqax.kernels.attention import training_attention
from seqax.kernels.grouped_swiglu import grouped_swiglu
from seqax.multihost import console_name, initialize_distributed, make_mesh, run_program, wait_for_all_processes
from seqax.muon_sharding import (fans, layer_matrices, matrix_groups, one_stack, orthogonalized_here, rows_back,
                                 rows_first)
from seqax.records import RunRecords, resumed
from seqax.shardlib.float8 import E5M2
from seqax.shardlib.shardops import all_gather, all_gather_cast, all_to_all, einsum_unreduced, global_norm
from seqax.shardlib.shardops import index_unreduced, inverse, pmax, pmean, psum, psum_scatter, ragged_all_to_all
from seqax.shardlib.shardops import take_unreduced, vary_as
from seqax.shardlib.shardtypes import Array, Masked, bool_, f32, make_partition_specs, make_shardings, pytree_dataclass
from seqax.shardlib.shardtypes import typechecked, typed_shard_map, u32
from seqax.signals import PreemptionWatch
from seqax.validation import check_attention_blocks, validate_config
from seqax.xla_cpu import normal_drawn_as, transposed_weight
from seqax.xla_tpu import add_tpu_flags

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
    expert_gate: f32[b"E/d M/c/t H"]  # expert parallelism: E / d experts a device (experts_block)
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
    balance_loss: f32[b""]  # this device's share of the sequence-wise balance loss (experts_block)


def init_weights(arch: ModelConfig, key: jax.Array) -> Model:
    """Normal weights with std 1/sqrt(fan_in) (embeddings: std 1), norms at 1. Run under jit
    with sharded outputs: each device draws only its shard, and the values do not depend on
    the mesh (threefry is partitionable)."""
    M, Q, K, D, F, V, layers = arch.d_model, arch.n_q_per_kv, arch.n_kv, arch.d_head, arch.d_ff, arch.vocab, arch.layers
    E, H = arch.experts, arch.expert_d_ff

    def normal(name, shape, fan_in, drawn_as=None):  # drawn_as: the same values, drawn faster on XLA:CPU
        return normal_drawn_as(fold_in_str(key, name), shape, drawn_as or shape) / math.sqrt(fan_in)

    weights = Layer(
        attn_norm=jnp.ones((layers, M)),
        w_q=normal("w_q", (layers, M, Q, K, D), M, drawn_as=(layers, M * Q, K * D)),
        w_k=normal("w_k", (layers, M, K, D), M, drawn_as=(layers, M, K * D)),
        w_v=normal("w_v", (layers, M, K, D), M, drawn_as=(layers, M, K * D)),
        w_o=normal("w_o", (layers, Q, K, D, M), Q * K * D, drawn_as=(layers * Q, K * D, M)),
        ffn_norm=jnp.ones((layers, M)),
        w_gate=normal("w_gate", (layers, M, F), M),
        w_up=normal("w_up", (layers, M, F), M),
        w_down=normal("w_down", (layers, F, M), F),
        router=normal("router", (layers, M, E), M),
        expert_bias=jnp.zeros((layers, E)),
        expert_gate=normal("expert_gate", (layers, E, M, H), M),
        expert_up=normal("expert_up", (layers, E, M, H), M),
        expert_down=normal("expert_down", (layers, E, H, M), H),
    )
    return Model(embed=normal("embed", (V, M), 1), layers=weights, final_norm=jnp.ones((M,)),
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
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, in float32 (x of any type)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rms_norm_bound(weight):
    """A bound on |rms_norm(x, weight)| for every x, from the weight alone: |x_i| <= sqrt(sum_j x_j^2) =
    sqrt(M mean(x^2)), so a normed value is at most sqrt(M) max|weight| (eps only lowers it). Float8 scales
    the normed stream by it (einsum_unreduced's first_amax): known before the norm runs, no pass over its output."""
    return math.sqrt(weight.shape[-1]) * jnp.max(jnp.abs(weight))


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


def attention_block(arch: ModelConfig, x, w: Layer, rotation, attend):
    """Pre-RMSNorm grouped-query attention (Ainslie et al. 2023: Q query heads share each of the K kv heads)
    with RoPE (rotation: rope_rotation's sin and cos) on the residual stream x [B/d, L/c, M/t] (float32).
    `attend(q, k, v) -> (o, extra)` is the attention proper: training attends within documents
    (training_layer); sample.py attends over its KV cache and returns the updated cache as `extra`.
    Returns (x plus the block's output, extra)."""
    dtype, multiply_in = arch.operand_dtype, arch.matmul_dtype  # float8: bfloat16 operands, scaled and cast to e4m3
    nx = all_gather("B/d L/c M/t -> B/d L/c M", x)  # the norm needs all of M
    nx = save_for_backward(rms_norm(nx, w.attn_norm, arch.norm_eps).astype(dtype))
    # FSDP: gather this layer's weights over d and c, cast to the matmul type before they cross the
    # wire; the gradients come back as float32 reduce-scatters (all_gather_cast's transpose).
    w_q = all_gather_cast("M/d/c Q K/t D -> M Q K/t D", w.w_q, dtype)
    w_k = all_gather_cast("M/d/c K/t D -> M K/t D", w.w_k, dtype)
    w_v = all_gather_cast("M/d/c K/t D -> M K/t D", w.w_v, dtype)
    # float8: nx scaled by its norm's bound, not its own amax
    project = partial(einsum_unreduced, multiply_in=multiply_in, first_amax=rms_norm_bound(w.attn_norm))
    q = project("B/d L/c M, M Q K/t D -> B/d L/c Q K/t D", nx, w_q)
    k = project("B/d S/c M, M K/t D -> B/d S/c K/t D", nx, w_k)
    v = project("B/d S/c M, M K/t D -> B/d S/c K/t D", nx, w_v).astype(dtype)
    q, k = rope(q, *rotation).astype(dtype), rope(k, *rotation).astype(dtype)
    # Training's attend (attention.training_attention's kernel) keeps q, k, v, o and its log-sum-exp for backward.
    o, extra = attend(q, k, v)  # [B/d, L/c, Q, K/t, D]
    w_o = all_gather_cast("Q K/t D M/d/c -> Q K/t D M", w.w_o, dtype)
    out = einsum_unreduced("B/d L/c Q K/t D, Q K/t D M -> B/d L/c M", o, w_o, multiply_in=multiply_in)  # sums over t
    return save_for_backward(x + psum_scatter("B/d L/c M -> B/d L/c M/t", out)), extra


def mlp_block(arch: ModelConfig, nx, nx_bound, w: Layer):
    """SwiGLU (Shazeer 2020): (silu(nx w_gate) * nx w_up) w_down of the normed stream nx [B/d, L/c, M]
    (the matmul type; |nx| <= nx_bound, its norm's rms_norm_bound): [B/d, L/c, M], float32 partial sums over t."""
    dtype, multiply_in = arch.operand_dtype, arch.matmul_dtype
    w_gate = all_gather_cast("M/d/c F/t -> M F/t", w.w_gate, dtype)
    w_up = all_gather_cast("M/d/c F/t -> M F/t", w.w_up, dtype)
    project = partial(einsum_unreduced, multiply_in=multiply_in, first_amax=nx_bound)  # float8: as attention's
    gate = project("B/d L/c M, M F/t -> B/d L/c F/t", nx, w_gate)
    up = project("B/d L/c M, M F/t -> B/d L/c F/t", nx, w_up)
    gate, up = save_for_backward(gate.astype(dtype)), save_for_backward(up.astype(dtype))
    gate_f32 = gate.astype(jnp.float32)  # silu(gate) * up in float32, rounded once (as grouped_swiglu)
    hidden = (gate_f32 * jax.nn.sigmoid(gate_f32) * up).astype(dtype)
    w_down = all_gather_cast("F/t M/d/c -> F/t M", w.w_down, dtype)
    w_down = transposed_weight(w_down)
    return einsum_unreduced("B/d L/c F/t, M F/t -> B/d L/c M", hidden, w_down, multiply_in=multiply_in)


def experts_block(arch: ModelConfig, normed, nx, w: Layer) -> tuple[jax.Array, Routing]:
    """The mixture of experts on the normed stream [B/d, L/c, M], `normed` in float32 and nx its rounding to
    the matmul type: its output [B/d, L/c, M] (float32, partial sums over t) and the layer's Routing. The
    router reads `normed`: a choice that a rounding of nx could flip would differ between meshes, whose
    float32 sums differ in their last bits. Each token goes to the top_k (experts_per_token) experts of
    highest score + expert_bias and returns the sum of their SwiGLUs, weighed by its gates: the sigmoids of
    its router logits at the chosen experts, normalized to sum to 1 (DeepSeek-V3, Liu et al. 2024: the bias
    balances the load by changing who is picked, never a gate's value).

    Expert parallelism over d: device i of d holds experts i E/d .. (i + 1) E/d - 1 (split over c and t
    FSDP-style, gathered a layer at a time), and each row (a token's choice of an expert) goes to its
    expert's device and back, a ragged all-to-all each way. The t devices of a group hold the same tokens:
    each sends its share of them (expert_dispatch.py), so that a row is computed once, whole (all of H), and
    its output rounded once to the matmul type: the same on any mesh. Dropless: every row is computed,
    whichever device it lands on, by the same matmuls; grouped_swiglu runs each expert's SwiGLU over the
    blocks of rows it got only: a loop whose length is the load. Buffers are sized for the worst load
    (every row of the d devices to one device), the work for the real one."""
    B, L, M = nx.shape
    E, top_k, dtype, multiply_in = arch.experts, arch.experts_per_token, arch.operand_dtype, arch.matmul_dtype
    scores = jax.nn.sigmoid(jnp.einsum("blm,me->ble", normed, w.router))  # float32 [B, L, E]
    _, chosen = lax.top_k(lax.stop_gradient(scores) + w.expert_bias, top_k)  # [B, L, top_k]; a tie: the lower index
    gates = jnp.take_along_axis(scores, chosen, axis=-1)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    picked = jnp.sum(chosen[..., None] == jnp.arange(E), axis=(1, 2), dtype=jnp.int32)  # [B, E] per sequence
    # Dispatch: this device's share of the group's tokens, its N rows in expert order to their experts' devices.
    d, t = lax.axis_size("d"), lax.axis_size("t")
    route = plan_dispatch(chosen, E, d, t, lax.axis_index("t"))
    N = route.expert.size
    received = ragged_all_to_all("N M -> d N M", route.rows_in_expert_order(nx), route.sizes)  # slot s: device s's
    sent = all_to_all("I/d E -> I E/d", route.count[None, :E])  # [d, E/d]: rows each device sent each expert here
    listed, ends, expected = received_blocks(sent, N, arch.expert_block)
    # The experts here, whole: gathered over c and t (FSDP) and cast (float8: each block's in grouped_swiglu).
    gate_w = all_gather_cast("E/d M/c/t H -> E/d M H", w.expert_gate, dtype)
    up_w = all_gather_cast("E/d M/c/t H -> E/d M H", w.expert_up, dtype)
    down_w = all_gather_cast("E/d H M/c/t -> E/d H M", w.expert_down, dtype)
    # Each block's SwiGLU (silu(x gate_w) * x up_w) down_w by its expert's weights, as mlp_block's math,
    # rounded to the matmul type and written over the received rows (no second buffer of d N rows).
    out = grouped_swiglu(received.reshape(d * N, M), listed, gate_w, up_w, down_w, ends, expected, multiply_in)
    # Back here, in row order; kept for backward (N rows, not the d N of the buffers), else recomputed.
    out = save_for_backward(ragged_all_to_all("d N M -> N M", out.reshape(d, N, M), route.sizes)[route.position])
    out = jnp.einsum("tkm,tk->tm", out.reshape(route.tokens, top_k, M), route.share(gates, 0.0))  # float32
    out = route.in_group_tokens(out, B * L)  # zeros in the other shares: partial sums over t, as mlp_block's
    # The sequence-wise balance loss (DeepSeek-V3, eq. 17-20) of each row: sum_i f_i P_i, f_i = E / top_k x the
    # fraction of the row's choices that picked expert i (whole rows: a sum over c), P_i = expert i's mean
    # score, normalized over experts. Linear in P: each device adds its positions' share. Mean over rows.
    row_length = L * lax.axis_size("c")
    f = psum("B E", picked.astype(jnp.float32), "c") * (jnp.float32(E) / (top_k * row_length))  # (no experts: empty)
    P = jnp.sum(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1) / row_length
    # The t devices of a group hold the same value: their mean is the value, invariant over t. (Were
    # it added to the loss on each t device, autodiff would count it, and the cross-entropy, t times.)
    balance_loss = pmean("", jnp.sum(lax.stop_gradient(f) * P), "t") / (B * lax.axis_size("d"))
    return out.reshape(B, L, M), Routing(jnp.sum(picked, axis=0).astype(jnp.float32), balance_loss)


def transformer_layer(arch: ModelConfig, x, w: Layer, rotation, attend):
    """One block on the residual stream x [B/d, L/c, M/t] (float32): attention_block, then pre-RMSNorm
    mlp_block plus experts_block (nothing when model.experts is 0). Returns (x after the block, attend's
    extra, Routing)."""
    x, extra = attention_block(arch, x, w, rotation, attend)
    normed = rms_norm(all_gather("B/d L/c M/t -> B/d L/c M", x), w.ffn_norm, arch.norm_eps)  # float32
    nx = save_for_backward(normed.astype(arch.operand_dtype))
    out = mlp_block(arch, nx, rms_norm_bound(w.ffn_norm), w)
    experts_out, routing = experts_block(arch, normed, nx, w)
    return x + psum_scatter("B/d L/c M -> B/d L/c M/t", out + experts_out), extra, routing


@typechecked
def training_layer(arch: ModelConfig, x: f32[b"B/d L/c M/t"], w: Layer, doc_start: u32[b"B/d L/c"],
                   sin: f32[b"B/d L/c R"], cos: f32[b"B/d L/c R"],
                   row_position: u32[b"L/c"]) -> tuple[f32[b"B/d L/c M/t"], Routing]:
    """transformer_layer as training runs it: causal attention within documents, by blocks, over
    the keys of every device of the c ring (row_position: where each token sits in the row), by the
    kernel model.attention_kernel names: "auto" is the fast one for the mesh's platform (Pallas on GPUs
    and TPUs, blockwise on CPUs); "reference" is the readable one whose gradient is autodiff's (README)."""
    attention = training_attention(arch.attention_kernel)

    def attend(q, k, v):
        return attention(q, k, v, doc_start, row_position, arch.attention_block), None

    x, _, routing = transformer_layer(arch, x, w, (sin, cos), attend)
    return x, routing


def embed_tokens(w: Model, inputs):
    """The residual stream [B/d, L/c, M/t] (float32) of input tokens [B/d, L/c]. FSDP without gathering the
    table: each device looks the whole batch's tokens up in its own columns (M/d/c), and an all-to-all brings
    each device its tokens' whole rows. Nothing of the table's size (V x M) is on a device (a gathered table
    and its gradient: 4 GiB in float32 at Llama 3's 128,256 x 4,096), and a device sends and receives its
    tokens' rows, not the table. Float32 on the wire: the gradient sums many tokens' rows."""
    tokens = all_gather("B/d L/c -> B L", inputs)
    columns = index_unreduced("V/t M/d/c, B L -> B L M/d/c", w.embed, tokens)
    rows = all_to_all("B L M/d/c -> B/d L/c M", columns)
    return psum_scatter("B/d L/c M -> B/d L/c M/t", rows)


def gathered_unembedding(arch: ModelConfig, w: Model):
    """The unembedding [M, V/t] as output_logits multiplies it: gathered over d and c (FSDP), in bfloat16."""
    return all_gather_cast("M/d/c V/t -> M V/t", w.unembed, arch.operand_dtype)


def output_logits(arch: ModelConfig, final_norm, unembed, x, logit_gradient_bound=None):
    """Next-token logits [B/d, L/c, V/t] (float32, this device's slice of V) of the residual stream x;
    unembed: gathered_unembedding's. logit_gradient_bound: a bound on the loss's gradient by a logit (float8
    scales that gradient by it), or None."""
    nx = rms_norm(all_gather("B/d L/c M/t -> B/d L/c M", x), final_norm, arch.norm_eps).astype(arch.operand_dtype)
    # float8: the logits' gradient (softmax - one-hot) is mostly the softmax's tail, far below its bound: e5m2
    # holds values down to about 2^-31.8 of the bound, e4m3 (the layers' gradients) only to about 2^-17.8.
    return einsum_unreduced("B/d L/c M, M V/t -> B/d L/c V/t", nx, unembed, multiply_in=arch.matmul_dtype,
                            first_amax=rms_norm_bound(final_norm), gradient_amax=logit_gradient_bound,
                            gradient_float8=E5M2)


@typechecked
def residual_stream(arch: ModelConfig, w: Model, inputs: u32[b"B/d L/c"],
                    is_seq_start: bool_[b"B/d L/c"]) -> tuple[f32[b"B/d L/c M/t"], Array[b"layers", Routing]]:
    """The residual stream after the last layer at every position of packed documents, and each layer's
    Routing (stacked). The input of a document's first position is token 0 (begin of document)."""
    length = inputs.shape[1] * lax.axis_size("c")
    check_attention_blocks(arch, length, lax.axis_size("c"))
    # With c > 1 a token's document start and position depend on other devices' chunks: whole rows and back.
    doc_start, position = (this_devices_chunks(x) for x in document_positions(whole_rows(is_seq_start)))
    row_position = this_devices_chunks(jnp.arange(length, dtype=jnp.uint32)[None, :])[0]
    sin, cos = rope_rotation(position, arch.d_head, arch.rope_base)
    x = embed_tokens(w, inputs)

    @explicit_activation_checkpointing
    def body(x, layer_weights):
        return training_layer(arch, x, layer_weights, doc_start, sin, cos, row_position)

    # A Python loop, not lax.scan: a scan copies every value saved for backward into a [layers, ...]
    # stack and back out: 11-12% of a 1B step on an H200 (docs/performance.md). Compile time grows with layers.
    routings = []
    for i in range(arch.layers):
        x, routing = body(x, jax.tree.map(operator.itemgetter(i), w.layers))  # layer i's weights
        routings.append(routing)
    return x, jax.tree.map(lambda *layers: jnp.stack(layers), *routings)


@typechecked
def forward(arch: ModelConfig, w: Model, inputs: u32[b"B/d L/c"],
            is_seq_start: bool_[b"B/d L/c"]) -> tuple[f32[b"B/d L/c V/t"], Array[b"layers", Routing]]:
    """Next-token logits at every position of packed documents, and each layer's Routing (stacked)."""
    x, routing = residual_stream(arch, w, inputs, is_seq_start)
    return output_logits(arch, w.final_norm, gathered_unembedding(arch, w), x), routing


def model_inputs(targets: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"]) -> u32[b"B/d L/c"]:
    """The inputs that predict `targets`: the targets shifted right by one position (the model at position i
    sees token i - 1 and predicts token i). At a document's first position the input is token 0 (begin of
    document), not the previous document's last token, so every token of a document is a target. The shift is
    done on whole rows: with c > 1 the input of a chunk's first position is the last target of another
    device's chunk."""
    row_targets, row_starts = whole_rows(targets), whole_rows(is_seq_start)
    shifted = jnp.pad(row_targets[:, :-1], ((0, 0), (1, 0)))  # [B/d, L]: position i holds target i - 1
    return this_devices_chunks(jnp.where(row_starts, 0, shifted))


def token_cross_entropy(arch: ModelConfig, final_norm, unembed, x, targets, logit_gradient_bound=None):
    """-log p(target) [B/d, n] at each of n positions of the residual stream x [B/d, n, M/t]; unembed:
    gathered_unembedding's; logit_gradient_bound: output_logits'."""
    logits = output_logits(arch, final_norm, unembed, x, logit_gradient_bound)  # float32
    # Cross-entropy over a vocabulary split across t: log-sum-exp and the target's logit each
    # need one sum over t; take_unreduced picks the target's logit on the device holding it.
    max_logit = pmax("B/d L/c", lax.stop_gradient(jnp.max(logits, axis=-1)), "t")
    sum_exp = psum("B/d L/c", jnp.sum(jnp.exp(logits - max_logit[..., None]), axis=-1), "t")
    target_logit = psum("B/d L/c", take_unreduced("B/d L/c V/t, B/d L/c -> B/d L/c", logits, targets), "t")
    return max_logit + jnp.log(sum_exp) - target_logit


# The loss goes over each device's positions in model.loss_parts parts: the logits (a vocabulary of floats a
# position) of one part exist at a time. in_parts: [B/d, L/c, ...] -> [parts, B/d, L/c / parts, ...].
def in_parts(parts: int, *xs):
    return tuple(jnp.moveaxis(x.reshape(x.shape[0], parts, x.shape[1] // parts, *x.shape[2:]), 1, 0) for x in xs)


def joined_parts(x):  # in_parts' inverse
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def losses_by_parts(arch: ModelConfig, final_norm, unembed, x, targets):
    """token_cross_entropy [B/d, L/c] of every position, one of model.loss_parts parts at a time."""
    return joined_parts(lax.map(lambda xs: token_cross_entropy(arch, final_norm, unembed, *xs),
                                in_parts(arch.loss_parts, x, targets)))


@typechecked
def token_losses(arch: ModelConfig, w: Model, targets: u32[b"B/d L/c"],
                 is_seq_start: bool_[b"B/d L/c"]) -> tuple[f32[b"B/d L/c"], Array[b"layers", Routing]]:
    """The next-token cross-entropy of every target of packed documents: -log p(target), and each
    layer's Routing. Not for differentiating: training's loss is weighted_cross_entropy's."""
    x, routing = residual_stream(arch, w, model_inputs(targets, is_seq_start), is_seq_start)
    return losses_by_parts(arch, w.final_norm, gathered_unembedding(arch, w), x, targets), routing


def weighted_cross_entropy(arch: ModelConfig, final_norm, unembed, x, targets, weights, logit_gradient_bound):
    """The sum over this device's positions of weights x token_cross_entropy. final_norm is made varying over
    the devices first: the gradient below is then each device's own, and autodiff sums it over them."""
    return cross_entropy_sum(arch, vary_as(final_norm, x), unembed, x, targets, weights, logit_gradient_bound)


# The cross-entropy's gradient computed with it, part by part (jax.vjp, the part's weights as the
# cotangent), and kept for the backward pass in place of the logits: a part's logits, exponentials and their
# gradient exist only while that part is done (Llama 3's vocabulary, 4,096 positions a device: 2 GiB each
# in float32), and the backward pass scales the kept gradients by the sum's cotangent.
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def cross_entropy_sum(arch: ModelConfig, final_norm, unembed, x, targets, weights, logit_gradient_bound):
    return jnp.sum(weights * losses_by_parts(arch, final_norm, unembed, x, targets))


def cross_entropy_sum_and_gradient(arch: ModelConfig, final_norm, unembed, x, targets, weights, logit_gradient_bound):
    def part(totals, part_of):
        x, targets, weights = part_of
        losses, part_vjp = jax.vjp(lambda *w_x: token_cross_entropy(arch, *w_x, targets, logit_gradient_bound),
                                    final_norm, unembed, x)
        d_norm, d_unembed, d_x = part_vjp(weights)
        loss, g_norm, g_unembed = totals
        return (loss + jnp.sum(weights * losses), g_norm + d_norm, g_unembed + d_unembed.astype(jnp.float32)), d_x

    zero = (vary_as(jnp.zeros((), jnp.float32), weights), vary_as(jnp.zeros_like(final_norm), final_norm),
            vary_as(jnp.zeros(unembed.shape, jnp.float32), unembed))
    (loss, d_norm, d_unembed), d_x = lax.scan(part, zero, in_parts(arch.loss_parts, x, targets, weights))
    return loss, (d_norm, d_unembed.astype(unembed.dtype), joined_parts(d_x))


def cross_entropy_sum_backward(arch: ModelConfig, gradients, cotangent):
    d_norm, d_unembed, d_x = gradients
    return d_norm * cotangent, (d_unembed * cotangent).astype(d_unembed.dtype), d_x * cotangent, None, None, None


cross_entropy_sum.defvjp(cross_entropy_sum_and_gradient, cross_entropy_sum_backward)


def model_loss(arch: ModelConfig, balance_weight: float, w: Model, targets, is_seq_start, loss_mask):
    """This device's share of what training minimizes: the mean token cross-entropy over the global batch's
    real tokens (not padding: loss_mask), plus balance_weight x the layers' balance losses. Also returns the
    cross-entropy share alone and the experts' loads [layers, E] (aux)."""
    global_tokens = jnp.maximum(psum("", jnp.sum(loss_mask, dtype=jnp.float32), ("d", "c")), 1)
    x, routing = residual_stream(arch, w, model_inputs(targets, is_seq_start), is_seq_start)
    # d loss / d logit = (softmax - one-hot) / global_tokens for a real token, 0 for padding: at most 1 / global_tokens.
    loss = weighted_cross_entropy(arch, w.final_norm, gathered_unembedding(arch, w), x, targets,
                                  jnp.where(loss_mask, 1 / global_tokens, 0.0), 1 / global_tokens)
    return loss + balance_weight * jnp.sum(routing.balance_loss), (loss, routing.load)


# ---------------------------------------------------------------------------------------------
# Optimizers: Muon (Jordan et al. 2024, as modded-nanogpt defines it) for the layers' matrices, AdamW
# (Loshchilov & Hutter 2019; Kingma & Ba 2015's bias correction) for all other weights. Both take the
# gradient clipped to a global norm, decay weights decoupled and follow one schedule.

# Muon's weights, read off Layer's annotations: every matrix of the layers, d_model against the rest (E
# stacks the experts' matrices); gains, biases and the router go to AdamW (muon_sharding.layer_matrices).
# name -> LayerMatrix (how the stacked layers spread over all devices, each then holding whole matrices, M
# first). `MUON = {}`: AdamW alone.
MUON = layer_matrices(Layer)
NEWTON_SCHULZ_STEPS = 5


def schedule(training: TrainingConfig, step):
    """The fraction of the peak learning rates that step `step` (0-based) uses: linear warmup over
    warmup_steps, then cosine decay to final_learning_rate_fraction at the last step."""
    step, final = step.astype(jnp.float32), training.final_learning_rate_fraction
    warmup = (step + 1) / max(training.warmup_steps, 1)
    progress = jnp.clip((step - training.warmup_steps) / max(training.steps - 1 - training.warmup_steps, 1), 0.0, 1.0)
    return jnp.where(step < training.warmup_steps, warmup, final + (1 - final) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))


def adamw_update(training: TrainingConfig, step, lr, w, g, mu, nu):
    """One AdamW step of one weight array, the `step`-th (0-based)."""
    mu = training.adam_b1 * mu + (1 - training.adam_b1) * g
    nu = training.adam_b2 * nu + (1 - training.adam_b2) * g * g
    count = step.astype(jnp.float32) + 1  # updates so far, this one included: the bias correction's exponent
    mu_hat, nu_hat = mu / (1 - training.adam_b1**count), nu / (1 - training.adam_b2**count)
    return w - lr * (mu_hat / (jnp.sqrt(nu_hat) + training.adam_eps) + training.weight_decay * w), mu, nu


def newton_schulz(G, dtype):
    """U V^T of each matrix G = U S V^T [..., rows, cols] (rows <= cols), approximately: X <- aX +
    (bA + cA^2)X with A = X X^T (the smaller Gram matrix), from X = G / ||G|| (every singular value at
    most 1), whose coefficients Jordan et al. 2024 chose to bring singular values to about [0.7, 1.2]
    fast. A stack of matrices goes as batched matmuls: a few large kernels, not many small ones.
    Operands in `dtype` (the matmul type), sums in float32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    mm = partial(jnp.einsum, preferred_element_type=jnp.float32)
    X = G.astype(jnp.float32)
    X = X / (jnp.sqrt(jnp.sum(X * X, axis=(-2, -1), keepdims=True)) + 1e-7)
    for _ in range(NEWTON_SCHULZ_STEPS):
        X_ = X.astype(dtype)
        A = mm("...ik,...jk->...ij", X_, X_)  # X X^T, contracting both on their last dimension: no transposed copy
        B = b * A + c * mm("...ij,...jk->...ik", A.astype(dtype), A.astype(dtype))
        X = a * X + mm("...ij,...jk->...ik", B.astype(dtype), X_)
    return X


def muon_update(training: TrainingConfig, dtype, lr, names: list[str], w: Layer, g: Layer, momentum: Layer) -> dict:
    """One Muon step of the stacked layer weights `names` of w [layers, ...], which share one shape M first
    (muon_sharding.matrix_groups): Nesterov momentum, then each layer's matrices orthogonalized by the
    device that holds them whole, scaled by sqrt(max(1, fan_out / fan_in)) (modded-nanogpt's
    max(1, rows / cols) of torch's [out, in] layout); decoupled weight decay. {name: (weight, momentum)}."""
    beta, layers = training.muon_momentum, getattr(w, names[0]).shape[0]
    momentum = {n: beta * getattr(momentum, n) + (1 - beta) * getattr(g, n) for n in names}
    nesterov = {n: (1 - beta) * getattr(g, n) + beta * momentum[n] for n in names}  # the gradient, then where it leads
    # Every device orthogonalizes whole matrices: the weights' stacked layers, M first, one stack (padded to a
    # multiple of the devices) spread over all devices, and back to the weights' sharding (muon_sharding.py).
    spread, matrix = MUON[names[0]].spread, MUON[names[0]].matrix
    stack = one_stack([rows_first(nesterov[n].astype(dtype), MUON[n]) for n in names], lax.axis_size(("d", "c", "t")))
    whole = all_to_all(spread, stack)
    update = orthogonalized_here(partial(newton_schulz, dtype=dtype), whole, matrix, len(names) * layers, dtype)
    update = all_to_all(inverse(spread), update)
    new = {}
    for i, n in enumerate(names):
        fan_in, fan_out = fans(whole, MUON[n])
        scale = math.sqrt(max(1.0, fan_out / max(fan_in, 1)))  # (fan_in 0: the empty experts of a dense model)
        change = rows_back(update[i * layers : (i + 1) * layers], MUON[n]).astype(jnp.float32)
        new[n] = getattr(w, n) - lr * (scale * change + training.muon_weight_decay * getattr(w, n)), momentum[n]
    return new


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


def optimizer_step(cfg: Config, step, state: State, grads: Model, grad_norm, load) -> tuple[State, jax.Array]:
    """Muon on the weights MUON names, AdamW on the rest, from the gradients clipped to the global
    norm `grad_norm`; the experts' bias by their load [layers, E] of this step's batch. Returns the
    new state and AdamW's learning rate."""
    training = cfg.training
    fraction = schedule(training, step)
    muon_lr, adamw_lr = training.muon_learning_rate * fraction, training.learning_rate * fraction
    clip = jnp.minimum(1.0, training.grad_clip / jnp.maximum(grad_norm, 1e-30))
    grads = jax.tree.map(lambda g: g * clip, grads)
    muon = {}  # name -> (weight, momentum): the weights MUON names, a group of one shape (M first) at a time
    for names in matrix_groups(MUON, cfg.model.layers, lax.axis_size(("d", "c", "t"))):
        muon |= muon_update(training, cfg.model.operand_dtype, muon_lr, names, state.weights.layers, grads.layers,
                            state.muon_momentum.layers)

    def update(path, w, g, momentum, mu, nu) -> Update:  # the state holds momentum or moments, None for the other
        rule = optimizer_of(path)
        if rule == "muon":
            w, momentum = muon[path[-1].name]
        elif rule == "balance":
            w = balance_update(training, w, load)
        else:
            w, mu, nu = adamw_update(training, step, adamw_lr, w, g, mu, nu)
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
        loss, load = psum("", loss, ("d", "c")), psum("layers E", load, ("d", "c", "t")) / lax.axis_size("t")
        grad_norm = global_norm(grads, Model)  # each gradient is sharded as its weight
        state, lr = optimizer_step(cfg, step, state, grads, grad_norm, load)
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


def model_flops_per_token(arch: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (MFU's numerator; seqax/analysis/flops.py counts them from the weights' shapes)."""
    return flops.model_flops_per_token(arch, seq_len, init_weights)


def newton_schulz_flops(arch: ModelConfig, devices: int) -> tuple[float, float]:
    """FLOPs of a step's Newton-Schulz iterations, in all and on the busiest device (seqax/analysis/flops.py)."""
    return flops.newton_schulz_flops(arch, devices, init_weights, MUON, NEWTON_SCHULZ_STEPS)


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
        # No state with a NaN or inf is saved; closed with the run's error, a diverged run says where to resume.
        checkpointer = opened.enter_context(Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoints,
                                                         finite_only=True))
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
            read = {"weights": state.weights} if done == start else checkpointer.read_or_warn(
                done, {"weights": shapes.weights}, {"weights": make_shardings(Model, mesh)},
                f"its evaluation is skipped (lost) and training goes on from checkpoint {start}")
            if read is not None:
                records.eval(done, evaluation, partial(eval_step, read["weights"], cfg=cfg))
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
        else:  # a signal during the last evaluation: nothing is left to save
            if preemption.requested:
                print(f"{console_name()}: {preemption.why()} during the last evaluation: the run is complete at step "
                      f"{cfg.training.steps} (its checkpoint committed)", file=sys.stderr, flush=True)
    return state


def main():
    """`python -m train --config-name=NAME [key=value ...]`: hydra's command line (config.run_hydra)."""
    def program(hydra_cfg: DictConfig):
        cfg = config_from_dict(Config, OmegaConf.to_container(hydra_cfg, resolve=True))
        add_tpu_flags()  # libtpu's, read when JAX starts its TPU backend: collectives on the SparseCores
        initialize_distributed(cfg.distributed)  # before any other JAX call
        train(cfg, OmegaConf.to_yaml(hydra_cfg, resolve=True))

    run_program(lambda: run_hydra(program))


if __name__ == "__main__":
    main()
