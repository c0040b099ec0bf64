"""Training throughput of configs on this machine's devices, as one table: median step time after
warm-up, tokens/s, MFU and peak memory per device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.throughput \\
        --config local_test_synthetic local_bench_cpu [--steps 10] [--warmup 3] [--timeout 600] \\
        [--budget SECONDS] [--json rows.json] [-- key=value ...]

Each config runs in a child process of its own (bench/measure_step.py), so that a crash, an
out-of-memory error or a timeout of one config becomes a row that says why, and each peak memory
figure is one config's alone; this process never imports JAX, which on a GPU would take memory
that the children need. A config whose mesh does not match the number of devices is a "skipped"
row. Hydra overrides after `--` apply to every config. --timeout limits each config (start-up
and compile included); --budget limits them all together, in order: a config that no time is
left for is a "not run" row. The table is printed last, on stdout, as Markdown; progress goes to
stderr. The exit status is 0 whenever the table is printed: the rows carry each outcome.

MFU is model FLOPs/s (train.model_flops_per_token) over the peak bf16 rate of the devices
(hardware.peak_flops: a table of accelerators; on CPU the measured bf16->f32 matmul rate of
the whole machine). Peak memory per device is measured where the backend counts it (GPU, TPU:
the largest `peak_bytes_in_use` of device.memory_stats(), "measured") and otherwise (CPU) is
XLA's memory_analysis() of the compiled step ("XLA estimate"). Batches are random tokens.
"""

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


@dataclasses.dataclass
class Row:
    """One config's line of the table (and of --json)."""

    config: str
    status: str  # ok, skipped, failed, timeout, not run
    note: str = ""  # why it is not ok; for an ok row, what MFU is relative to
    devices: str = ""  # count x kind, e.g. "8 x cpu"
    mesh: str = ""
    steps: int = 0  # timed steps, after `warmup` untimed ones
    warmup: int = 0
    tokens_per_step: int = 0
    step_time_median_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None  # per device
    peak_memory_source: str = ""  # "measured" (device.memory_stats) or "XLA estimate" (memory_analysis)
    compile_seconds: float | None = None
    # The roofline's step time of the compiled step on this device (seqax/analysis/roofline.py), where
    # seqax/analysis/targets.py knows the device: next to the measured one, it calibrates the model.
    predicted_step_time_s: float | None = None


def last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1][:300] if lines else "nothing"


def show_log_tail(name: str, path: str, lines: int = 20):
    with open(path, errors="replace") as f:
        tail = f.readlines()[-lines:]
    print(f"--- last lines of {name}'s output ---\n{''.join(tail).rstrip()}\n---", file=sys.stderr, flush=True)


def run_child(name: str, args, timeout: float) -> Row:
    """Runs one config in a child process, in a session of its own so that a timeout, or an
    interrupt or SIGTERM of this process, kills all of it (a SIGKILL of this process cannot)."""
    with tempfile.TemporaryDirectory() as tmp:
        row_file, log_file = os.path.join(tmp, "row.json"), os.path.join(tmp, "log.txt")
        command = [sys.executable, "-m", "bench.measure_step", "--config", name, "--row-file", row_file,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--", *args.overrides]
        timed_out = False
        with open(log_file, "w") as log:
            # A stop that arrives while Popen starts the child waits until `child` is set, inside the try:
            # raised in Popen, it would leave the child running with nothing to kill it.
            STOPS["deferred"] = True
            try:
                child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                STOPS["deferred"] = False
            try:
                if STOPS["pending"]:
                    stop(STOPS["pending"].pop(), None)
                child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
        if timed_out:
            show_log_tail(name, log_file)
            limit = f"{timeout:.0f} s" + ("" if timeout >= args.timeout
                                          else f" (all that --budget had left; --timeout is {args.timeout:.0f} s)")
            return Row(config=name, status="timeout",
                       note=f"no result within {limit}; its last line: {last_line(log_file)}")
        if not os.path.exists(row_file):  # killed from outside, e.g. by the kernel's out-of-memory killer
            show_log_tail(name, log_file)
            how = f"signal {-child.returncode}" if child.returncode < 0 else f"status {child.returncode}"
            return Row(config=name, status="failed",
                       note=f"the child process ended with {how} and no result; its last line: {last_line(log_file)}")
        with open(row_file) as f:
            row = Row(**json.load(f))
        if row.status == "failed":
            show_log_tail(name, log_file)
        return row


def run_all(args) -> list[Row]:
    """A row per config, in order, each within --timeout and all within --budget."""
    rows = []
    started = time.monotonic()
    for name in args.config:
        left = args.budget - (time.monotonic() - started) if args.budget else args.timeout
        if left <= 0:
            rows.append(Row(config=name, status="not run",
                            note=f"the --budget of {args.budget:.0f} s was spent on the configs before it"))
            continue
        config_started = time.monotonic()
        row = run_child(name, args, min(args.timeout, left))
        summary = f"{row.step_time_median_s:.3f} s a step" if row.status == "ok" else row.note
        print(f"bench.throughput: {name}: {row.status}: {summary} ({time.monotonic() - config_started:.0f} s)",
              file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def format_memory(row: Row) -> str:
    return (f"{row.peak_memory_bytes / GiB:.2f} GiB ({row.peak_memory_source})" if row.peak_memory_bytes is not None
            else "")


def format_row(row: Row) -> list[str]:
    if row.status != "ok":
        return [row.config, row.devices, row.mesh, row.status, "", "", "", "", "", row.note]
    step_time = f"{row.step_time_median_s:.3f} s ({row.step_time_min_s:.3f}-{row.step_time_max_s:.3f})"
    mfu = f"{row.mfu:.1%}" if row.mfu is not None else "n/a"
    predicted = (f"{row.predicted_step_time_s:.3f} s (x{row.step_time_median_s / row.predicted_step_time_s:.2f})"
                 if row.predicted_step_time_s else "")
    return [row.config, row.devices, row.mesh, f"{row.steps} after {row.warmup}", step_time, predicted,
            f"{row.tokens_per_second:,.0f}", mfu, format_memory(row), row.note]


HEADER = ["config", "devices", "mesh", "steps", "step time, median (min-max)", "roofline (measured / it)",
          "tokens/s", "MFU", "peak memory per device", "note"]


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (a "|" inside a cell is escaped)."""
    cells = [HEADER] + [[cell.replace("|", "\\|") for cell in format_row(row)] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADER))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(line, widths)) + " |" for line in cells]
    lines.insert(1, "| " + " | ".join("-" * width for width in widths) + " |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["local_test_synthetic"],
                        help="config names (configs/NAME.yaml), timed in this order")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per config")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds each config may take, start-up and compile included")
    parser.add_argument("--budget", type=float, default=0, help="seconds all configs may take together (0: no limit)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    parser.add_argument("overrides", nargs="*",
                        help="hydra overrides for every config, after --, e.g. -- mesh.d=8 mesh.t=1")
    args = parser.parse_args(argv)
    for name in args.config:
        if "=" in name:
            parser.error(f"config name {name!r} looks like an override: put hydra overrides after --, "
                         f"e.g. --config NAME -- {name}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


STOPS = {"deferred": False, "pending": []}  # while run_child starts a child, stops wait in "pending"


def stop(signum, frame):
    """SIGTERM (a timeout of the command that runs this, a job ending) raises SystemExit and Ctrl-C
    KeyboardInterrupt, so that run_child's `finally` kills the running child's process group: a child
    left behind would keep its share of the GPU's memory."""
    if STOPS["deferred"]:
        STOPS["pending"].append(signum)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    sys.exit(128 + signum)


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rows = run_all(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(row) for row in rows], f, indent=1)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
