"""Context parallelism (mesh.c): memory per device as c grows, and step time at long sequences.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.context_parallel \\
        [--memory-length 8192] [--lengths 4096 8192 16384 32768] [--steps 2] [-- key=value ...]

Both parts use local_test_synthetic's model (d_model 256, 2 layers, d_ff 1024) with 8 kv heads
of 32 (one query head each, so that t = 8 splits them), attention_block 256, and one row a step
of one document (no block skipped by documents).
1. Memory: the step compiled ahead of time (nothing allocated) at c = 1, 2, 4, 8 on c devices
   (d = t = 1), rows of --memory-length: the memory report's activations per device (what the
   layers save for backward, the logits) from the code's annotations, and XLA's temporaries
   and peak from memory_analysis(). Activations should fall as 1/c.
2. Speed: on all 8 devices, the step at c = 8 (the row split over the ring) against c = 1 with
   t = 8 (each device holds the whole row and 1/8 of the heads), median seconds of --steps
   steps after one warm-up.
"""

import argparse

import jax
import numpy as np

import train
from bench.measure_step import time_steps
from bench.memory import accelerator_estimate
from seqax import config
from seqax.analysis import memory
from seqax.analysis.startup_report import compile_step

MiB = 2**20
MODEL = ["model.attention_block=256", "training.tokens.batch=1", "model.n_kv=8", "model.n_q_per_kv=1"]


def load(length: int, d: int, t: int, c: int, overrides: list[str]) -> config.Config:
    return config.load_config("local_test_synthetic", ["+paths.model_name=context", *MODEL,
                                                       f"training.tokens.len={length}", f"mesh.d={d}", f"mesh.t={t}",
                                                       f"mesh.c={c}", *overrides])


def memory_row(length: int, c: int, overrides: list[str]) -> dict:
    cfg = load(length, 1, 1, c, overrides)
    mesh = train.make_mesh(1, 1, c, devices=jax.devices()[:c])
    terms, state, _ = accelerator_estimate(cfg, mesh)
    with jax.set_mesh(mesh):
        analysis = compile_step(train.training_step, cfg, state, mesh).memory_analysis()
    activations = sum(size for name, size in terms if name.startswith(("saved for backward", "logits")))
    return {"c": c, "activations": activations, "temp": analysis.temp_size_in_bytes,
            "peak": memory.compiled_peak_bytes(analysis)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-length", type=int, default=8192, help="0: skip the memory part")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}; "
          f"local_test_synthetic with {' '.join(MODEL + args.overrides)}")

    if args.memory_length:
        print(f"\nMemory per device, rows of {args.memory_length}, c devices (d = t = 1):")
        print(f"{'c':>3} {'activations (annotations)':>26} {'x c':>9} {'XLA temporaries':>16} "
              f"{'x c':>9} {'XLA peak':>10}")
    for c in (1, 2, 4, 8) if args.memory_length else ():
        row = memory_row(args.memory_length, c, args.overrides)
        print(f"{c:>3} {row['activations'] / MiB:>22.1f} MiB {row['activations'] * c / MiB:>9.1f} "
              f"{row['temp'] / MiB:>12.1f} MiB {row['temp'] * c / MiB:>9.1f} {row['peak'] / MiB:>6.1f} MiB", flush=True)

    print(f"\nStep time on {jax.device_count()} devices, one row, median of {args.steps} steps after one warm-up:")
    print(f"{'length':>7} {'c=1 t=8':>10} {'c=8':>10} {'c=8 / c=1':>10}")
    for length in args.lengths:
        seconds = {}
        for t, c in ((8, 1), (1, 8)):
            _, _, times = time_steps(load(length, 1, t, c, args.overrides), args.steps, warmup=1)
            seconds[c] = float(np.median(times))
        print(f"{length:>7} {seconds[1]:>8.2f} s {seconds[8]:>8.2f} s {seconds[8] / seconds[1]:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
