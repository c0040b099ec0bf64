"""Dense against blockwise attention: forward + backward time and XLA's temporary memory.

    .venv/bin/python -m bench.attention [--batch 4 --heads 8 --kv-heads 2 --d-head 64]
        [--lengths 512 1024 2048] [--blocks 128 256 512] [--repeats 5]

Runs attention.dense_attention (the L x S scores materialized, attention.causal_document_mask's
mask) and attention.ring_attention on a ring of one device (block pairs, causal half only,
online softmax, custom backward) on one device with random bfloat16 inputs and about four documents a row, and prints
one row per (length, method): median time of value-and-gradient, the speed-up over dense, and
the compiled program's temporary bytes.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import train
from seqax import attention


def attention_inputs(B: int, L: int, Q: int, K: int, D: int):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, L, Q, K, D)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, L, K, D)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, L, K, D)), jnp.bfloat16)
    starts = rng.random((B, L)) < 4 / L  # about four documents per row
    starts[:, 0] = True
    doc_start, _ = train.document_positions(jnp.asarray(starts))
    return q, k, v, doc_start


def dense(q, k, v, doc_start):
    position = jnp.arange(q.shape[1])
    return attention.dense_attention(q, k, v, attention.causal_document_mask(position, position, doc_start, doc_start))


def blockwise(block: int):
    """attention.ring_attention inside shard_map on one device: its ring is its own keys."""
    mesh = train.make_mesh(1, 1, devices=jax.devices()[:1])

    def attend(q, k, v, doc_start):
        row_position = jnp.arange(q.shape[1], dtype=jnp.uint32)
        return jax.shard_map(lambda *a: attention.ring_attention(*a, row_position, block), mesh=mesh, in_specs=P(),
                             out_specs=P())(q, k, v, doc_start)

    return attend


def value_and_grad(attend):
    """The compiled forward + backward of attention, the gradient flowing from a fixed cotangent."""

    def loss(q, k, v, doc_start):
        return jnp.sum(attend(q, k, v, doc_start).astype(jnp.float32)
                       * jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8, help="query heads (Q x K)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    print(f"device {jax.devices()[0].device_kind}; batch {args.batch}, {args.heads} query heads, "
          f"{args.kv_heads} kv heads, d_head {args.d_head}")
    print(f"{'L':>6} {'method':>16} {'fwd+bwd ms':>11} {'vs dense':>9} {'temp MiB':>9}")
    for L in args.lengths:
        inputs = attention_inputs(args.batch, L, args.heads // args.kv_heads, args.kv_heads, args.d_head)
        dense_time, dense_temp = measure(value_and_grad(dense), inputs, args.repeats)
        print(f"{L:>6} {'dense':>16} {dense_time * 1e3:>11.1f} {'1.00x':>9} {dense_temp / 2**20:>9.1f}", flush=True)
        for block in args.blocks:
            if L % block or block > L:
                continue
            seconds, temp = measure(value_and_grad(blockwise(block)), inputs, args.repeats)
            print(f"{L:>6} {f'blockwise {block}':>16} {seconds * 1e3:>11.1f} {dense_time / seconds:>8.2f}x "
                  f"{temp / 2**20:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
