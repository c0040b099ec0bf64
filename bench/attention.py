"""Attention alone, forward + backward, by each kernel, on this machine's device
(bench/attention_for.py compiles the same for a GPU or TPU that is not here).

    .venv/bin/python -m bench.attention [--batch 4 --heads 8 --kv-heads 2 --d-head 64]
        [--lengths 512 1024 2048] [--blocks 128 256 512] [--methods dense blockwise ...] [--repeats 5]
        [--documents 4]

Methods: dense (attention.dense_attention, every score of a row materialized), blockwise
(attention.ring_attention on a ring of one device, blocks of each --blocks), pallas (the flash
kernels of flash_attention.py for the device, blocks chosen for it), pallas_triton and pallas_hopper
(one GPU lowering of them: Triton's, Mosaic GPU's), cudnn (jax.nn.dot_product_attention's cuDNN kernel,
causal only: no documents; the speed anchor on a GPU), jax_mgpu (JAX's own Mosaic GPU attention example,
jax.experimental.pallas.ops.gpu.attention_mgpu: causal, no documents, all heads as many kv heads, and
forward only, as its causal backward is not written). Inputs are random bfloat16 with about --documents
documents a row (4; with 1, every row one document: all the causal pairs, the work cuDNN's kernel does,
whose FLOP rate is printed too: 6 B Q K L^2 D FLOPs over the time). By default, the methods the device
runs fast: dense and blockwise on a CPU; blockwise, both Pallas lowerings, cudnn and jax_mgpu on a GPU;
blockwise and pallas on a TPU.

It prints one row per (length, method): the median time of value-and-gradient after a warm-up,
the speed-up over the first method, and the compiled program's temporary bytes (jax_mgpu: forward only,
its FLOP rate over the forward's 2 B Q K L^2 D FLOPs).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import train
from seqax.kernels import attention

DEFAULT_METHODS = {"cpu": ("dense", "blockwise"),
                   "gpu": ("blockwise", "pallas_triton", "pallas_hopper", "cudnn", "jax_mgpu"),
                   "tpu": ("blockwise", "pallas")}
FORWARD_ONLY = ("jax_mgpu",)


def attention_inputs(B: int, L: int, Q: int, K: int, D: int, documents: int = 4):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, L, Q, K, D)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, L, K, D)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, L, K, D)), jnp.bfloat16)
    starts = rng.random((B, L)) < (documents - 1) / L  # about `documents` documents per row
    starts[:, 0] = True
    doc_start, _ = train.document_positions(jnp.asarray(starts))
    return q, k, v, doc_start


def dense(q, k, v, doc_start):
    position = jnp.arange(q.shape[1])
    return attention.dense_attention(q, k, v, attention.causal_document_mask(position, position, doc_start, doc_start))


def cudnn(q, k, v, doc_start):
    """jax.nn.dot_product_attention's cuDNN kernel, causal only (it takes no document starts); the
    query heads as [K, Q] so that query head n reads kv head n // Q, as grouped heads do there."""
    del doc_start
    B, L, Q, K, D = q.shape
    q = jnp.swapaxes(q, 2, 3).reshape(B, L, K * Q, D)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jnp.swapaxes(o.reshape(B, L, K, Q, D), 2, 3)


def jax_mgpu(q, k, v, doc_start):
    """JAX's Mosaic GPU attention example, causal (no documents), forward: heads [B, L, K Q, D] over k, v
    repeated to K Q heads (the example's kv heads are its query heads' groups, but its blocks want them
    whole)."""
    del doc_start
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    B, L, Q, K, D = q.shape
    q = jnp.swapaxes(q, 2, 3).reshape(B, L, K * Q, D)
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
    o = attention_mgpu.attention(q, jnp.repeat(k, Q, axis=2), jnp.repeat(v, Q, axis=2), config)
    return jnp.swapaxes(o.reshape(B, L, K, Q, D), 2, 3)


def kernel_on_one_device(kernel: str, block: int, mesh):
    """attention.kernel_for(kernel) on the mesh's platform inside shard_map on one device: a ring of
    its own keys."""
    def attend(q, k, v, doc_start):
        row_position = jnp.arange(q.shape[1], dtype=jnp.uint32)
        device = mesh.devices.flat[0]
        chosen = attention.kernel_for(kernel, device.platform, device.device_kind)
        return jax.shard_map(lambda *a: chosen(*a, row_position, block), mesh=mesh, in_specs=P(), out_specs=P())(
            q, k, v, doc_start)

    return attend


def method(name: str, block: int, mesh):
    return {"dense": dense, "cudnn": cudnn, "jax_mgpu": jax_mgpu}.get(name) or kernel_on_one_device(name, block, mesh)


def value_and_grad(attend):
    """The compiled forward + backward of attention, the gradient flowing from a fixed cotangent."""

    def loss(q, k, v, doc_start):
        return jnp.sum(attend(q, k, v, doc_start).astype(jnp.float32)
                       * jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def forward(attend):
    return jax.jit(lambda q, k, v, doc_start: attend(q, k, v, doc_start))


def measure(fn, args, repeats: int) -> tuple[float, int]:
    """(median seconds per call after one warm-up, temporary bytes of the compiled program)."""
    compiled = fn.lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), temp


def on_this_device(args):
    mesh = train.make_mesh(1, 1, devices=jax.devices()[:1])
    methods = args.methods or DEFAULT_METHODS[jax.devices()[0].platform]
    print(f"device {jax.devices()[0].device_kind}; batch {args.batch}, {args.heads} query heads, "
          f"{args.kv_heads} kv heads, d_head {args.d_head}, about {args.documents} document(s) a row")
    causal = args.documents == 1
    header = f"{'L':>6} {'method':>16} {'fwd+bwd ms':>11} {'speed-up':>9} {'temp MiB':>9}"
    print(header + (" TFLOP/s" if causal else ""))
    for L in args.lengths:
        inputs = attention_inputs(args.batch, L, args.heads // args.kv_heads, args.kv_heads, args.d_head,
                                  args.documents)
        flops = 6 * args.batch * args.heads * L * L * args.d_head  # causal attention, forward + backward
        first = None
        for name in methods:
            for block in args.blocks if name == "blockwise" else [max(b for b in args.blocks if L % b == 0)]:
                if L % block:
                    continue
                timed = forward if name in FORWARD_ONLY else value_and_grad
                seconds, temp = measure(timed(method(name, block, mesh)), inputs, args.repeats)
                first = first or seconds
                label = f"{name} {block}" if name == "blockwise" else name
                work = flops / 3 if name in FORWARD_ONLY else flops  # the forward: 2 of the 6
                rate = f" {work / seconds / 1e12:>7.1f}" if causal else ""
                print(f"{L:>6} {label:>16} {seconds * 1e3:>11.1f} {first / seconds:>8.2f}x {temp / 2**20:>9.1f}{rate}",
                      flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8, help="query heads (Q x K)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--methods", nargs="+", choices=["dense", "blockwise", "pallas", "pallas_triton",
                                                         "pallas_hopper", "cudnn", "jax_mgpu"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--documents", type=int, default=4, help="documents a row, about (1: causal only)")
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error(f"--documents {args.documents} must be at least 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    on_this_device(args)


if __name__ == "__main__":
    main()
