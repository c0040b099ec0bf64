"""Learning and step time by matmul type: the same config, tokens and seeds with model.matmul_dtype
bfloat16 and float8 (or any of config.MATMUL_DTYPES), side by side.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.matmul_dtypes \\
        [--config local_test_text] [--dtypes bfloat16 float8] [--seeds 0 1] [--output runs/matmul_dtypes] \\
        [-- key=value ...]

Each run is `python -m train` in a child process (training.seed: the initial weights; the batches are the
same), named CONFIG-DTYPE-seedN under --output, so that `python -m tools.plot_metrics` draws their curves
side by side. Runs already there with their last evaluation are read, not run again. Prints, per seed,
each type's final eval_loss and its ratio to the first type's, and the median step time (a CPU runs
float8 as conversions around float32 arithmetic: its step time says nothing of a GPU's).
"""

import argparse
import os
import subprocess
import sys

import numpy as np

from seqax.config import MATMUL_DTYPES, load_config
from tools.plot_metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(run_dir: str) -> tuple[list[tuple[int, float]], list[float]]:
    """(step, eval_loss) of every evaluation and the step times (s) of a run, as tools.plot_metrics reads
    its metrics.jsonl (a step logged twice counts once)."""
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        return [], []
    series = read_metrics(run_dir)
    return sorted(series.get("eval_loss", {}).items()), [t for _, t in sorted(series.get("step_time", {}).items())]


def run(config: str, dtype: str, seed: int, steps: int, output: str, overrides: list[str]):
    """The run's evaluations and step times; trains it unless its metrics end with the last evaluation."""
    name = f"{config}-{dtype}-seed{seed}"
    run_dir = os.path.join(output, name)
    evals, times = read(run_dir)
    if not evals or evals[-1][0] != steps:
        print(f"running {name}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "train", f"--config-path={os.path.join(ROOT, 'configs')}",
                        f"--config-name={config}", f"+paths.model_name={name}", f"paths.root_working_dir={output}",
                        f"model.matmul_dtype={dtype}", f"training.seed={seed}", "checkpoint_interval=0",
                        *overrides], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        evals, times = read(run_dir)
    return evals, times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="local_test_text")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float8"], choices=MATMUL_DTYPES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--output", default=os.path.join(ROOT, "runs", "matmul_dtypes"))
    parser.add_argument("overrides", nargs="*", help="hydra overrides after --")
    args = parser.parse_args(argv)
    steps = load_config(args.config, ["+paths.model_name=x", *args.overrides]).training.steps
    print(f"{args.config}, {steps} steps: final eval_loss (ratio to {args.dtypes[0]}'s), median step time")
    for seed in args.seeds:
        first = None
        for dtype in args.dtypes:
            evals, times = run(args.config, dtype, seed, steps, args.output, args.overrides)
            final = evals[-1][1]
            first = first or final
            print(f"seed {seed}  {dtype:<9} {final:.4f} ({final / first:.4f})  {np.median(times[1:]) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
