"""The roofline model (seqax/analysis/roofline.py) checked where it can be: on this CPU, predicted against
measured step time.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.roofline_cpu \\
        [--config local_bench_cpu] [--steps 10] [-- key=value ...]

It measures this machine's rates as the step meets them, every simulated device at once (they
share the cores): the bf16 -> f32 matmul rate (hardware.py's measurement), the FP32 elementwise
rate, the memory bandwidth of a large copy and the cost of one small kernel (a loop of tiny
fusions); each per device. Then it compiles the config's step for this CPU, times it, and prints
the roofline's step time and where it goes next to the measured median: the ratio measured /
predicted says how far XLA:CPU's program is from its roofline.
"""

import argparse
import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train
from bench.compile_for import category
from bench.measure_step import time_steps
from seqax.analysis import hardware, roofline
from seqax.config import load_config


def on_every_device(f, per_device_shape, dtype=jnp.float32):
    """f jitted over all local devices, each on its own block of per_device_shape, and its input."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    x = jax.device_put(np.ones((len(devices) * per_device_shape[0], *per_device_shape[1:]), dtype),
                       NamedSharding(mesh, P("all")))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("all"), out_specs=P("all"))), x, mesh


def median_seconds(f, x, mesh, repeats: int = 5) -> float:
    with jax.set_mesh(mesh):
        jax.block_until_ready(f(x))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def measured_rates() -> roofline.Rates:
    """This CPU's rates per simulated device, all devices running at once."""
    devices = jax.local_device_count()
    matmul = hardware.measure_cpu_matmul_flops() / devices
    n = 1 << 22  # 16 MiB of float32 per device: far beyond the caches
    copy, x, mesh = on_every_device(lambda a: a[::-1] + 0.0, (n,))
    bandwidth = 2 * 4 * n / median_seconds(copy, x, mesh)  # read and written
    def chain(a):  # 16 elementwise operations a value, fused into one kernel over a cache-sized block
        for _ in range(8):
            a = a * 1.0001 + 0.5
        return a

    vector, x, mesh = on_every_device(chain, (65536,))
    vector_flops = 16 * 65536 / median_seconds(vector, x, mesh)
    loops = 1000  # a loop of tiny kernels: what one costs, beside its work
    tiny, x, mesh = on_every_device(lambda a: lax.fori_loop(0, loops, lambda i, a: a * 0.5 + 1.0, a), (8,))
    launch = median_seconds(tiny, x, mesh) / loops
    return roofline.Rates(matmul, vector_flops, bandwidth, link_bandwidth=bandwidth, network_bandwidth=bandwidth,
                          devices_per_host=devices, launch_seconds=launch)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="local_bench_cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="hydra overrides, after --")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides + ["+paths.model_name=roofline_cpu"])
    compiled, _, times = time_steps(cfg, args.steps, warmup=3)
    measured = float(np.median(times))
    rates = measured_rates()
    model = roofline.roofline(compiled.as_text(), rates)
    seconds = collections.Counter()
    for kernel in model.kernels:
        seconds[category(kernel)] += kernel.total_seconds
    print(f"{args.config} on {jax.device_count()} x {jax.devices()[0].device_kind}: per device, matmul "
          f"{rates.matmul_flops / 1e9:.1f} GFLOP/s, vector {rates.vector_flops / 1e9:.2f} GFLOP/s, memory "
          f"{rates.memory_bandwidth / 1e9:.2f} GB/s, {rates.launch_seconds * 1e6:.1f} us a kernel")
    print(f"measured step {measured * 1e3:.1f} ms (median of {args.steps}); roofline {model.step_seconds * 1e3:.1f} ms "
          f"({model.launches:,.0f} kernels); measured / predicted = {measured / model.step_seconds:.2f}")
    for kind, value in seconds.most_common():
        print(f"  {kind:<30} {value * 1e3:9.1f} ms {value / model.step_seconds:6.1%}")
    model_flops = train.model_flops_per_token(cfg.model, cfg.training.tokens.len) * cfg.training.tokens.batch \
        * cfg.training.tokens.len / jax.device_count()
    print(f"MFU ceiling {model_flops / (model.step_seconds * rates.matmul_flops):.1%} of the measured matmul rate; "
          f"measured {model_flops / (measured * rates.matmul_flops):.1%}")


if __name__ == "__main__":
    main()
