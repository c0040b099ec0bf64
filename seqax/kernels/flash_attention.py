"""Flash attention around the context-parallel ring: attention.ring_attention's contract (the same
arguments, the same numbers up to rounding) with each ring step one Pallas kernel: flash_hopper.py's
(Mosaic GPU) on Hopper GPUs, flash_gpu.py's (Triton) on other GPUs, flash_tpu.py's on TPUs; on CPUs
either GPU lowering in its interpret mode.

Each ring step runs the forward kernel on the visiting key and value shard, which gives that
shard's output and log-sum-exp; the steps merge exactly (o = sum_s exp(lse_s - lse) o_s, lse =
logsumexp_s lse_s). The backward pass runs the ring again: each step's kernels take the merged o
and lse, so that P = exp(S - lse) is that shard's share of the whole softmax and the step's
gradients are its share of the whole gradient; dq adds up here, and each shard's dk and dv travel
with it round the ring until they come home. With c = 1 the ring is one step, and the kernels
write their results in the inputs' dtype; with c > 1 in float32, rounded once after the sums.
"""

import math
import re
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from seqax.config import ConfigError
from seqax.jax_extra import save_in_forward_rule
from seqax.kernels import flash_gpu, flash_hopper, flash_tpu
from seqax.kernels.flash_blocks import F32, Tiling
from seqax.shardlib.bits import is_narrow_float
from seqax.shardlib.shardops import axis_size, einsum_unreduced, ring_pass

LOWERINGS = {"gpu": flash_gpu, "hopper": flash_hopper, "tpu": flash_tpu}
# The GPUs of compute capability 9.x (Hopper), by the device kind JAX names them with ("NVIDIA H100 80GB HBM3",
# "NVIDIA H200", "NVIDIA GH200 480GB", ...): inside a traced step only the abstract mesh's device kind is there
# to read, not the device's compute capability.
HOPPER_KINDS = re.compile(r"\bG?H(100|200|800|20)\b")
# What travels round the ring, in the model's layout: k, v (and their gradients), doc_start, row_position.
KV_SPECS = ("B/d S/c K/t D", "B/d S/c K/t D", "B/d S/c", "S/c")
# Block sizes that compile for an H200 (D = 128) and a TPU v6e, untuned (no device to time them on):
# on a GPU 64 x 64 up to 3 query heads per kv head, 32 x 64 beyond (at Q = 4 and 64 query rows the
# backward kernels ask for 297,472 bytes of shared memory, over the H200's 232,448); on a TPU
# 256 x 256 (v6e's matrix unit is 256 wide).
GPU_BLOCK_Q, GPU_BLOCK_Q_MANY_HEADS, GPU_BLOCK_K, TPU_BLOCK = 64, 32, 64, 256
# The smallest block and head size the GPU kernels take: each of block_q, block_k and D is a dimension of
# one of their matrix products, and Triton's front end refuses a tl.dot with a dimension under 16, a check
# that Pallas's Triton lowering does not make. On an H200 (2026-12-04) a training step with d_head 8 and
# blocks of 8 compiled and ran, its step-0 loss 1.4% off blockwise's.
GPU_MIN_DIM = 16


def lowering_for(kernel: str, platform: str, device_kind: str, d_head: int, attention_block: int) -> str:
    """Which Pallas kernels model.attention_kernel=`kernel` runs: "tpu" on a TPU; on a GPU (or a CPU,
    interpreted) "gpu" (Triton) for pallas_triton, "hopper" (Mosaic GPU) for pallas_hopper, and for pallas the
    Hopper kernels on a Hopper when their shapes fit (d_head and model.attention_block multiples of 64), else
    Triton's. Bad requests stop with one line."""
    if platform == "tpu":
        if kernel != "pallas":
            raise ConfigError(f"model.attention_kernel={kernel} is a GPU kernel; on a TPU choose pallas (or auto)")
        return "tpu"
    hopper = platform == "cpu" or bool(HOPPER_KINDS.search(device_kind))
    fits = d_head % flash_hopper.BLOCK == 0 and attention_block % flash_hopper.BLOCK == 0
    if kernel == "pallas_hopper" and not (hopper and fits):
        raise ConfigError(f"model.attention_kernel=pallas_hopper needs a Hopper GPU (compute capability 9.x; this is "
                          f"{device_kind or platform}) and model.d_head (here {d_head}) and model.attention_block "
                          f"(here {attention_block}) multiples of {flash_hopper.BLOCK}; choose pallas_triton or "
                          "blockwise")
    if kernel == "pallas_hopper" or (kernel == "pallas" and platform == "gpu" and hopper and fits):
        return "hopper"
    return "gpu"


def tiling_for(platform: str, q_per_kv: int, attention_block: int, length: int, lowering: str = "gpu") -> Tiling:
    """The blocks of `lowering`'s kernels on `platform`: the largest divisors of the preferred sizes that
    divide model.attention_block, which validation.py has checked divides each chunk of a device's
    `length` positions. A TPU block's lanes must be whole: a block that is not a multiple of 128
    becomes the whole length. The Hopper kernels' blocks are a wgmma tile's 64 rows. On a CPU, the GPU
    kernels in their interpret mode."""
    if lowering == "hopper":
        return Tiling("hopper", flash_hopper.BLOCK, flash_hopper.BLOCK, interpret=platform == "cpu")
    if platform == "tpu":
        block = math.gcd(TPU_BLOCK, attention_block)
        block = block if block % 128 == 0 else length
        return Tiling("tpu", block, block)
    block_q = GPU_BLOCK_Q if q_per_kv <= 3 else GPU_BLOCK_Q_MANY_HEADS
    return Tiling("gpu", math.gcd(block_q, attention_block), math.gcd(GPU_BLOCK_K, attention_block),
                  interpret=platform == "cpu")


def carried(shard):
    """A shard as the ring's loop carries it: k and v as their bits (shardlib/bits.py, as ring_pass
    sends them). XLA's GPU compiler fails on a loop that carries them as bf16 when a Pallas call
    reads them (a RET_CHECK: "bf16[...] is not compatible with u16[...]", jax 0.10.2)."""
    k, v, *rest = shard
    return (*(lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")) if is_narrow_float(x) else x
              for x in (k, v)), *rest)


def held(shard, dtype):
    """carried undone: k and v in `dtype` again, for the kernels."""
    k, v, *rest = shard
    return (*(x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype) for x in (k, v)), *rest)


def merge(o, lse, o_step, lse_step):
    """Two results over disjoint sets of keys as one: o [B, L, Q, K, D] and lse [B, L, Q, K]
    (float32), each o weighted by its share exp(lse_s - lse) of the joint softmax. A query that
    has seen no key on either side keeps o = 0, lse = -inf."""
    joint = jnp.logaddexp(lse, lse_step)
    safe = jnp.where(joint == -jnp.inf, 0.0, joint)
    return o * jnp.exp(lse - safe)[..., None] + o_step * jnp.exp(lse_step - safe)[..., None], joint


def ring_forward(q, shard, tiling: Tiling):
    """(o [B, L, Q, K, D] in q's dtype, lse [B, L, Q, K] float32) of q over every device's keys:
    c ring steps, starting with this device's own shard = (k, v, doc_start, row_position)."""
    lowering = LOWERINGS[tiling.lowering]
    _, _, q_doc_start, q_position = shard  # the queries' too: this device's own shard

    def attend(shard, o_dtype):
        k, v, k_doc_start, k_position = shard
        return lowering.forward(q, k, v, q_doc_start, k_doc_start, q_position, k_position, tiling, o_dtype)

    if axis_size("c") == 1:
        return attend(shard, q.dtype)

    def ring_step(carry, _):
        o, lse, shard = carry
        arriving = tuple(ring_pass(spec, x, "c") for spec, x in zip(KV_SPECS, shard))  # sent before the work
        return (*merge(o, lse, *attend(held(shard, q.dtype), F32)), arriving), None

    # The own shard's step outside the loop: its result starts the merge (no pass over a zero o), and the
    # loop runs the c - 1 steps of the others' shards, each passing its shard on before the work.
    arriving = tuple(ring_pass(spec, x, "c") for spec, x in zip(KV_SPECS, carried(shard)))
    o, lse = attend(shard, F32)
    (o, lse, _), _ = lax.scan(ring_step, (o, lse, arriving), None, length=axis_size("c") - 1)
    return o.astype(q.dtype), lse


def ring_backward(tiling: Tiling, saved, do):
    """Gradients of q, k, v from the output's gradient do [B, L, Q, K, D]: the ring again, each
    shard's dk and dv travelling with it (attention.ring_attention_backward's order of transfers)."""
    q, k, v, o, lse, doc_start, row_position = saved
    lowering = LOWERINGS[tiling.lowering]
    q_doc_start, q_position = doc_start.astype(jnp.int32), row_position.astype(jnp.int32)
    # rowsum(dO * O) = rowsum(dP * P): the softmax's Jacobian applied to dP, once for every ring step
    delta = einsum_unreduced("B/d L Q K/t D, B/d L Q K/t D -> B/d L Q K/t", do, o)

    def gradients(shard, dtype):
        k, v, k_doc_start, k_position = shard
        return lowering.backward(q, k, v, do.astype(q.dtype), lse, delta, q_doc_start, k_doc_start, q_position,
                                 k_position, tiling, dtype)

    own = (k, v, q_doc_start, q_position)
    if axis_size("c") == 1:
        return (*gradients(own, q.dtype), None, None)

    def ring_step(carry, _):
        dq, shard, dk_dv = carry
        # Both transfers start before the work: the next shard, and the gradients of the shard held
        # last step on to its next holder.
        arriving = tuple(ring_pass(spec, x, "c") for spec, x in zip(KV_SPECS, shard))
        dk_in, dv_in = (ring_pass(KV_SPECS[0], g, "c") for g in dk_dv)
        dq_step, dk, dv = gradients(held(shard, q.dtype), F32)
        return (dq + dq_step, arriving, (dk_in + dk, dv_in + dv)), None

    # The own shard's step outside the loop, as in ring_forward: its gradients start the sums.
    arriving = tuple(ring_pass(spec, x, "c") for spec, x in zip(KV_SPECS, carried(own)))
    dq, dk, dv = gradients(own, F32)
    (dq, _, dk_dv), _ = lax.scan(ring_step, (dq, arriving, (dk, dv)), None, length=axis_size("c") - 1)
    dk, dv = (ring_pass(KV_SPECS[0], g, "c") for g in dk_dv)  # the last holder sends them home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None  # integers: no cotangent


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_flash_attention(q, k, v, doc_start, row_position, tiling: Tiling):
    return ring_forward(q, (k, v, doc_start.astype(jnp.int32), row_position.astype(jnp.int32)), tiling)[0]


def _forward_saving(q, k, v, doc_start, row_position, tiling: Tiling):
    """The forward pass under differentiation. Kept for the backward pass (marked, so that layer
    rematerialization keeps them too): q, k, v, the output and its log-sum-exp; doc_start and
    row_position are the layer's arguments."""
    q, k, v = (save_in_forward_rule(x) for x in (q, k, v))
    o, lse = ring_forward(q, (k, v, doc_start.astype(jnp.int32), row_position.astype(jnp.int32)), tiling)
    o, lse = save_in_forward_rule(o), save_in_forward_rule(lse)
    return o, (q, k, v, o, lse, doc_start, row_position)


_ring_flash_attention.defvjp(_forward_saving, ring_backward)


def ring_flash_attention(q, k, v, doc_start, row_position, block: int, platform: str, kernel: str = "pallas",
                         device_kind: str = ""):
    """Causal grouped-query attention within documents of q [B, L, Q, K, D] over k, v [B, S, K, D]
    and the keys and values of every other device of mesh axis c, by the Pallas kernels that
    model.attention_kernel=`kernel` names for `platform` ("gpu", "tpu"; "cpu" interprets the GPU kernels)
    and `device_kind` (lowering_for), in blocks that divide `block` (tiling_for); doc_start [B, L] and
    row_position [L] as attention.ring_attention takes them. Runs inside shard_map."""
    lowering = lowering_for(kernel, platform, device_kind, q.shape[-1], block)
    tiling = tiling_for(platform, q.shape[2], block, q.shape[1], lowering)
    if lowering == "gpu" and platform == "gpu" and min(tiling.block_q, tiling.block_k, q.shape[-1]) < GPU_MIN_DIM:
        raise ConfigError(f"the Pallas attention kernels (model.attention_kernel=pallas, or auto on a GPU) need "
                          f"model.d_head (here {q.shape[-1]}) and their blocks (here {tiling.block_q} x "
                          f"{tiling.block_k}, from model.attention_block={block}) of at least {GPU_MIN_DIM} on a "
                          "GPU (Triton's matrix products); raise them, or choose model.attention_kernel=blockwise")
    if tiling.interpret and jax.typeof(q).manual_axis_type.varying:
        raise ConfigError(f"model.attention_kernel={kernel} cannot run on a CPU here: Pallas's interpret mode cannot "
                          "run inside a shard_map that checks varying mesh axes, as the training step's does (JAX "
                          "0.10.2; docs/flash-attention.md); choose model.attention_kernel=blockwise or reference")
    return _ring_flash_attention(q, k, v, doc_start, row_position, tiling)
