"""Step time of the training loop with a checkpoint saved every step, against no saving.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.checkpoint_async \\
        [--steps 10] [--rounds 4] [--compression none] [--keep 2] [key=value ...]

The loop is train.py's: dispatch step s, then read the metrics of step s-1 (RunRecords.after_step);
when a checkpoint is due, read those of step s too (RunRecords.flush) and `save(s + 1, state)`,
which returns after the device-to-host copy while the files are written in the background.
Batches are bench/measure_step.py's (random tokens, one document a row). Rounds alternate the
two modes so that a change in the machine's load hits both; the figures are medians.
"""

import argparse
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import train
from bench.measure_step import random_batch
from seqax import config
from seqax.checkpoint import Checkpointer
from seqax.config import CheckpointConfig


def step_times(cfg: config.Config, mesh, steps: int, directory: str | None,
               checkpoints: CheckpointConfig) -> tuple[list[float], list[float]]:
    """Wall time of each loop iteration after the first three, and of each save() call."""
    targets, starts, mask = random_batch(cfg, mesh)
    checkpointer = Checkpointer(directory, checkpoints) if directory else None
    times, saves = [], []
    with jax.set_mesh(mesh):
        state = train.init_state(cfg, mesh)
        pending, last = None, time.perf_counter()
        for step in range(3 + steps):
            state, metrics = train.training_step(state, jnp.uint32(step), targets, starts, mask, cfg)
            if pending is not None:
                jax.device_get(pending)  # what RunRecords.after_step waits for
            pending = metrics
            if checkpointer:
                checkpointer.check()
                jax.device_get(pending)  # RunRecords.flush
                pending = None
                start = time.perf_counter()
                checkpointer.save(step + 1, state)
                saves.append(time.perf_counter() - start)
            now = time.perf_counter()
            times.append(now - last)
            last = now
        jax.block_until_ready(state)
    if checkpointer:
        checkpointer.close()
        shutil.rmtree(directory)
    return times[3:], saves[3:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="local_test_synthetic")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--keep", type=int, default=2,
                        help="checkpoints kept: each save past the first `keep` deletes one")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. model.d_model=512")
    args = parser.parse_args(argv)
    cfg = config.load_config(args.config, args.overrides + ["+paths.model_name=bench"])
    mesh = train.make_mesh(cfg.mesh.d, cfg.mesh.t)
    state_bytes = sum(x.size * x.dtype.itemsize
                      for x in jax.tree.leaves(jax.eval_shape(lambda: train.init_state(cfg, mesh))))
    checkpoints = CheckpointConfig(keep=args.keep, compression=args.compression, level=3, threads=8)
    plain, saving, saves = [], [], []
    for _ in range(args.rounds):
        plain += step_times(cfg, mesh, args.steps, None, checkpoints)[0]
        times, calls = step_times(cfg, mesh, args.steps, tempfile.mkdtemp(prefix="seqax-bench-", dir=args.dir),
                                  checkpoints)
        saving, saves = saving + times, saves + calls
    print(f"config {args.config} {' '.join(args.overrides)}: state {state_bytes / 1e6:.1f} MB, "
          f"mesh d={cfg.mesh.d} t={cfg.mesh.t}, {checkpoints}")

    def summary(times):
        q1, q2, q3 = np.percentile(times, [25, 50, 75]) * 1000
        return f"median {q2:.0f} ms (quartiles {q1:.0f}-{q3:.0f}, {len(times)} steps)"

    print(f"step time, no checkpoints:      {summary(plain)}")
    print(f"step time, a checkpoint a step: {summary(saving)}; "
          f"save() itself blocked a median {np.median(saves) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
