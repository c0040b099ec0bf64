"""Learning and cost of the mixture of experts against the dense model with the same active
parameters and FLOPs per token: local_test_text (d_ff 768) against local_test_text_moe (8 experts of
384, 2 a token), on the same tokens and schedule.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.moe \\
        [--seeds 0 1] [--steps 200] [--eval-every 10] [--output runs/moe]

Each run is `python -m train` in a child process (the runs of a seed one after the other, dense
first, so that the machine's load falls on both alike), evaluating every --eval-every steps on 8
validation batches. Per seed it prints: each model's final eval_loss; MoE's eval_loss at dense's
last step's wall-clock (the sum of step times, evaluations left out); the step at which MoE's
eval_loss first reaches dense's final one (linear between evaluations), as a fraction of the
steps; the median step time of each and their ratio; and the expert load (the busiest expert's
rows over the mean, the layer where that is largest) at the start, middle and end. Then MoE once
more with expert_bias_rate 0 (seed 0): the load without the bias's balancing. Runs already in
--output with a final eval_loss are read, not run again.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from bench.optimizers import steps_to_reach

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config: str, name: str, steps: int, eval_every: int, output: str, *overrides: str) -> list[dict]:
    """The lines of a run's metrics.jsonl; runs it unless the file already has its last evaluation."""
    metrics = os.path.join(output, name, "metrics.jsonl")
    if not any(line.get("step") == steps and "eval_loss" in line for line in read(metrics)):
        print(f"running {name}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "train", f"--config-name={config}", f"+paths.model_name={name}",
                        f"paths.root_working_dir={output}", f"training.steps={steps}", f"eval_interval={eval_every}",
                        "eval_batches=8", "checkpoint_interval=0", *overrides], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    return read(metrics)


def read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def evals(lines: list[dict]) -> list[tuple[int, float]]:
    return sorted({line["step"]: line["eval_loss"] for line in lines if "eval_loss" in line}.items())


def wall_clock(lines: list[dict]) -> dict[int, float]:
    """Seconds of training (step times summed, evaluations left out) when each step had finished."""
    times = {line["step"]: line["step_time"] for line in lines if "step_time" in line}
    elapsed, total = {}, 0.0
    for step in sorted(times):
        total += times[step]
        elapsed[step + 1] = total  # after `step` (0-based), step + 1 steps are done
    return elapsed


def eval_at_seconds(lines: list[dict], seconds: float) -> float:
    """eval_loss after `seconds` of training, linear between evaluations."""
    clock = wall_clock(lines)
    points = [(clock[step], loss) for step, loss in evals(lines) if step in clock]
    return float(np.interp(seconds, [t for t, _ in points], [loss for _, loss in points]))


def load_at(lines: list[dict], fraction: float) -> float:
    loads = [line["expert_load"] for line in lines if "expert_load" in line]
    return loads[min(int(fraction * len(loads)), len(loads) - 1)]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--output", default=os.path.join(ROOT, "runs", "moe"))
    args = parser.parse_args(argv)
    go = lambda config, name, *o: run(config, name, args.steps, args.eval_every, args.output, *o)  # noqa: E731
    print("| seed | dense final eval_loss | MoE final | MoE at dense's wall-clock | MoE's steps to dense's final "
          "| step time dense, MoE (ratio) | expert load at 0, 1/2, end |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seed in args.seeds:
        dense = go("local_test_text", f"dense-seed{seed}", f"training.seed={seed}")
        moe = go("local_test_text_moe", f"moe-seed{seed}", f"training.seed={seed}")
        dense_final, moe_final = evals(dense)[-1][1], evals(moe)[-1][1]
        at_clock = eval_at_seconds(moe, wall_clock(dense)[args.steps])
        reach = steps_to_reach(evals(moe), dense_final)
        times = [float(np.median([line["step_time"] for line in lines[2:] if "step_time" in line]))
                 for lines in (dense, moe)]
        loads = ", ".join(f"{load_at(moe, f):.2f}" for f in (0.0, 0.5, 1.0))
        shown_reach = "never" if reach is None else f"{reach:.0f} ({reach / args.steps:.2f})"
        print(f"| {seed} | {dense_final:.4f} | {moe_final:.4f} | {at_clock:.4f} | {shown_reach} | "
              f"{times[0] * 1e3:.0f} ms, {times[1] * 1e3:.0f} ms ({times[1] / times[0]:.2f}x) | {loads} |", flush=True)
    unbiased = go("local_test_text_moe", "moe-no-bias-seed0", "training.seed=0", "training.expert_bias_rate=0")
    print(f"\nwithout the bias (expert_bias_rate 0, seed 0): final eval_loss {evals(unbiased)[-1][1]:.4f}, "
          f"expert load at 0, 1/2, end: {', '.join(f'{load_at(unbiased, f):.2f}' for f in (0.0, 0.5, 1.0))}")


if __name__ == "__main__":
    main()
