"""One config's training step measured in this process: compile time, step times after warm-up,
tokens/s, MFU and peak memory per device, written as one row of bench/throughput.py's table.

    .venv/bin/python -m bench.measure_step --config NAME --row-file ROW.json [--steps 10] [--warmup 3]
        [-- key=value ...]

bench/throughput.py runs this once per config, each in a process of its own; run it alone to
see one config's progress and traceback. Every failure becomes a "failed" row with the error's
first line (XLA's RESOURCE_EXHAUSTED when out of memory, a ConfigError with its fix, ...).
"""

import argparse
import dataclasses
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import train
from bench.throughput import Row
from seqax import config
from seqax.analysis import hardware, memory, roofline
from seqax.analysis.startup_report import compile_step
from seqax.analysis.targets import target_for
from seqax.validation import validate_config


def progress(text: str):
    """A line of this process's log; bench/throughput.py shows the last one on a timeout."""
    print(text, flush=True)


def random_tokens(cfg: config.Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(targets, is_seq_start, loss_mask) [B, L] on the host: random tokens, one document per row. One
    document: blockwise attention then computes every block pair on or below the diagonal, exactly the
    work the MFU formula counts (rows of short documents let it skip pairs: faster, but not the
    long-document case that a throughput figure should hold)."""
    B, L = cfg.training.tokens.batch, cfg.training.tokens.len
    targets = np.random.default_rng(0).integers(1, cfg.model.vocab, (B, L)).astype(np.uint32)
    return targets, np.arange(L)[None, :].repeat(B, 0) == 0, np.ones((B, L), bool)


def random_batch(cfg: config.Config, mesh):
    """random_tokens on the mesh's devices, sharded like the loader's batches: rows over d, positions
    over c (one document a row starts at position 0, which the zigzag layout puts first too)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", "c"))
    return tuple(jax.device_put(x, sharding) for x in random_tokens(cfg))


def compiled_step(cfg: config.Config):
    """The training step compiled ahead of time for cfg's mesh on this machine's first devices, a
    fresh state and a random batch: (mesh, the compiled step, state, batch, compile seconds). Run
    the step inside `jax.set_mesh(mesh)`."""
    mesh = train.make_mesh(cfg.mesh.d, cfg.mesh.t, cfg.mesh.c,
                           devices=jax.devices()[: cfg.mesh.d * cfg.mesh.t * cfg.mesh.c])
    batch = random_batch(cfg, mesh)
    with jax.set_mesh(mesh):
        state = train.init_state(cfg, mesh)
        started = time.perf_counter()
        step_fn = compile_step(train.training_step, cfg, state, mesh)
    return mesh, step_fn, state, batch, time.perf_counter() - started


def time_steps(cfg: config.Config, steps: int, warmup: int):
    """Compiles the training step ahead of time, then times warmup + steps steps.
    Returns (the compiled step, compile seconds, the times of the last `steps` steps)."""
    mesh, step_fn, state, batch, compile_seconds = compiled_step(cfg)
    progress(f"compiled in {compile_seconds:.1f} s")
    times = []
    with jax.set_mesh(mesh):
        for step in range(warmup + steps):
            start = time.perf_counter()
            state, metrics = step_fn(state, jnp.uint32(step), *batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
            progress(f"step {step} ({'warm-up' if step < warmup else 'timed'}): {times[-1]:.3f} s")
    return step_fn, compile_seconds, times[warmup:]


def peak_memory(compiled) -> tuple[int | None, str]:
    """Peak bytes per device and where the number comes from: the allocator's high-water mark
    where the backend keeps one (GPU, TPU), else XLA's memory_analysis() of the step (CPU)."""
    stats = [device.memory_stats() for device in jax.local_devices()]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        return max(s["peak_bytes_in_use"] for s in stats), "measured"
    analysis = compiled.memory_analysis()
    return (memory.compiled_peak_bytes(analysis), "XLA estimate") if analysis is not None else (None, "")


def measure(name: str, overrides: list[str], steps: int, warmup: int) -> Row:
    cfg = config.load_config(name, overrides + ["+paths.model_name=bench"])
    n = jax.device_count()
    mesh = f"d={cfg.mesh.d} t={cfg.mesh.t}" + (f" c={cfg.mesh.c}" if cfg.mesh.c > 1 else "")
    row = Row(config=name, status="ok", devices=f"{n} x {jax.devices()[0].device_kind}", mesh=mesh, steps=steps,
              warmup=warmup, tokens_per_step=cfg.training.tokens.batch * cfg.training.tokens.len)
    needed = cfg.mesh.d * cfg.mesh.t * cfg.mesh.c
    if needed != n:
        row.status, row.note = "skipped", f"its mesh is for {needed} device(s), this machine has {n}"
        return row
    validate_config(cfg, n, max_token_id=0, weights=train.Model)  # the batch: random tokens below model.vocab
    compiled, row.compile_seconds, times = time_steps(cfg, steps, warmup)
    row.step_time_median_s, row.step_time_min_s, row.step_time_max_s = float(np.median(times)), min(times), max(times)
    row.tokens_per_second = row.tokens_per_step / row.step_time_median_s
    row.peak_memory_bytes, row.peak_memory_source = peak_memory(compiled)
    peak, peak_source = hardware.peak_flops()  # on CPU a measurement: after the steps, so that it does not slow them
    row.mfu = (train.model_flops_per_token(cfg.model, cfg.training.tokens.len) * row.tokens_per_second / peak
               if peak else None)
    row.note = f"MFU of {peak / 1e12:.3g} TFLOP/s: {peak_source}" if peak else f"no peak FLOP/s known: {peak_source}"
    target = target_for(jax.devices()[0].device_kind)
    if target is not None:  # a GPU or TPU the roofline knows: its prediction for this very program
        try:
            row.predicted_step_time_s = roofline.roofline(compiled.as_text(), target.rates()).step_seconds
        except Exception as e:  # a model that cannot read this program must not cost the measurement
            row.note += f"; no roofline: {first_line(e)}"
    return row


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config name (configs/NAME.yaml)")
    parser.add_argument("--row-file", required=True, help="where the row is written, as JSON")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="hydra overrides, after --")
    args = parser.parse_args(argv)
    try:
        row = measure(args.config, args.overrides, args.steps, args.warmup)
    except Exception as e:  # one config's failure is a row of the table, not the end of the table
        traceback.print_exc()
        row = Row(config=args.config, status="failed", note=first_line(e))
    with open(args.row_file, "w") as f:
        json.dump(dataclasses.asdict(row), f)


if __name__ == "__main__":
    main()
