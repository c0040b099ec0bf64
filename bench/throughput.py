"""Median training-step time, tokens/s and MFU of a config on this machine's devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.throughput \\
        --config local_test_synthetic [--steps 10] [--warmup 3] [key=value ...]

MFU is model FLOPs/s over the peak bf16 rate of the devices (training_io.peak_flops: a table of
accelerators; on CPU the measured bf16->f32 matmul rate of the whole machine).
Batches are random tokens with documents of random length: the step's speed does not depend
on the data.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import train
import training_io


def load(name: str, overrides: list[str]) -> train.Config:
    return train.load_config(name, overrides + ["+paths.model_name=bench"])


def time_steps(h: train.Config, steps: int, warmup: int) -> list[float]:
    mesh = train.make_mesh(h.mesh.d, h.mesh.t)
    B, L = h.training.tokens.batch, h.training.tokens.len
    rng = np.random.default_rng(0)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    targets = jax.device_put(rng.integers(1, h.model.vocab, (B, L)).astype(np.uint32), sharding)
    starts = jax.device_put(rng.random((B, L)) < 0.02, sharding)
    mask = jax.device_put(np.ones((B, L), bool), sharding)
    times = []
    with jax.set_mesh(mesh):
        state = train.init_state(h, mesh)
        for step in range(warmup + steps):
            start = time.perf_counter()
            state, metrics = train.training_step(state, jnp.uint32(step), targets, starts, mask, h)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    return times[warmup:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="local_test_synthetic")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. model.d_model=512 mesh.d=8 mesh.t=1")
    args = parser.parse_args(argv)
    h = load(args.config, args.overrides)
    times = time_steps(h, args.steps, args.warmup)
    step_time = float(np.median(times))
    tokens = h.training.tokens.batch * h.training.tokens.len
    flops = training_io.model_flops_per_token(h.model, h.training.tokens.len) * tokens / step_time
    peak, peak_source = training_io.peak_flops()
    mfu = f"{flops / peak:.1%}" if peak else "n/a"
    print(f"config {args.config} {' '.join(args.overrides)}")
    print(f"devices {jax.device_count()} x {jax.devices()[0].device_kind}  mesh d={h.mesh.d} t={h.mesh.t}")
    print(f"step time median {step_time * 1000:.0f} ms (min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}, {len(times)} steps)")
    print(f"tokens/s {tokens / step_time:.0f}  model TFLOP/s {flops / 1e12:.3f}  MFU {mfu}" + (f" of {peak / 1e9:.0f} GFLOP/s ({peak_source})" if peak else ""))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
