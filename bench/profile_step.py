"""Where a config's training step spends its time on this machine's device, read off a profiler trace:
the step compiled and run twice untraced, then `--steps` steps traced (jax.profiler, with its perfetto
trace), and the device's events summed by name: for each of the device's timelines (its streams, XLA's
ops, XLA's modules) the total time and the costliest events with the program's name for each (its
op_name: the jitted function and the ops it came from). On a CPU, whose trace has no device, the
host's timelines are summed instead.

    python -m bench.profile_step --config gpu1_1b [--steps 2] [--top 25] [--out DIR] [-- key=value ...]

With --out, the trace (perfetto_trace.json.gz) and the compiled step's HLO (step.hlo.txt.gz: the
instructions the trace names, with their source lines) are copied there, as NAME.trace.json.gz and
NAME.hlo.txt.gz, to read further (https://ui.perfetto.dev opens the trace).
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp

import train
from bench.measure_step import compiled_step
from seqax import config
from seqax.validation import validate_config


def traced_steps(cfg: config.Config, steps: int, trace_dir: str) -> tuple[object, float]:
    """Compiles the step, runs two untraced, then traces `steps`. Returns (the compiled step, the
    traced steps' wall-clock seconds)."""
    mesh, step_fn, state, batch, _ = compiled_step(cfg)
    with jax.set_mesh(mesh):
        for step in range(2):
            state, metrics = step_fn(state, jnp.uint32(step), *batch)
        jax.block_until_ready((state, metrics))
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        start = time.perf_counter()
        for step in range(2, 2 + steps):
            state, metrics = step_fn(state, jnp.uint32(step), *batch)
        jax.block_until_ready((state, metrics))
        seconds = time.perf_counter() - start
        jax.profiler.stop_trace()
    return step_fn, seconds


def timelines(events: list[dict]) -> dict[str, dict[str, list]]:
    """{timeline name: {event name: [total microseconds, count, a program name]}} of the device's
    timelines (every timeline where the trace has no device)."""
    processes = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in processes.items() if re.search(r"GPU|TPU|/device:", name) and "CPU" not in name}
    summed: dict[str, dict[str, list]] = collections.defaultdict(dict)
    for e in events:
        if e.get("ph") != "X" or (device and e["pid"] not in device):
            continue
        line = f"{processes.get(e['pid'], e['pid'])} / {threads.get((e['pid'], e.get('tid')), e.get('tid'))}"
        entry = summed[line].setdefault(e["name"], [0.0, 0, ""])
        entry[0] += float(e.get("dur", 0))
        entry[1] += 1
        args = e.get("args", {})
        entry[2] = entry[2] or str(args.get("tf_op") or args.get("long_name") or args.get("hlo_op") or "")
    return summed


def report(summed: dict[str, dict[str, list]], steps: int, seconds: float, top: int):
    print(f"traced {steps} step(s): {seconds * 1e3 / steps:.1f} ms a step by the host's clock")
    for line, names in sorted(summed.items(), key=lambda kv: -sum(v[0] for v in kv[1].values())):
        total = sum(v[0] for v in names.values())
        print(f"\n{line}: {total / 1e3 / steps:.1f} ms a step in {sum(v[1] for v in names.values()) // steps} "
              f"events a step, {len(names)} names")
        for name, (us, count, program) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {us / 1e3 / steps:9.2f} ms {100 * us / total:5.1f}%  x{count // steps:<5} {name[:60]:60}  "
                  f"{program[-110:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", help="where to copy the trace and the step's HLO")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, after --")
    args = parser.parse_args(argv)
    cfg = config.load_config(args.config, args.overrides + ["+paths.model_name=profile"])
    validate_config(cfg, jax.device_count(), max_token_id=0, weights=train.Model)
    with tempfile.TemporaryDirectory() as trace_dir:
        step_fn, seconds = traced_steps(cfg, args.steps, trace_dir)
        traces = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if not traces:
            raise SystemExit(f"bench.profile_step: error: the profiler wrote no perfetto_trace.json.gz in {trace_dir}")
        with gzip.open(traces[0], "rt") as f:
            data = json.load(f)
        report(timelines(data["traceEvents"] if isinstance(data, dict) else data), args.steps, seconds, args.top)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            shutil.copy(traces[0], os.path.join(args.out, f"{args.config}.trace.json.gz"))
            with gzip.open(os.path.join(args.out, f"{args.config}.hlo.txt.gz"), "wt") as f:
                f.write(step_fn.as_text())


if __name__ == "__main__":
    main()
