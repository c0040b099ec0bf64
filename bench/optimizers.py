"""Learning per step: Muon (train.MUON's weights) with AdamW for the rest, against AdamW alone, on
the same tokens and schedule, each at its best peak learning rate of a small sweep.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.optimizers \\
        [--config local_test_text local_test_synthetic] [--adamw-rates R R R] [--muon-rates R R R] \\
        [--seeds 0 1] [--eval-every 10] [--output runs/optimizers]

Per config: AdamW alone at each of --adamw-rates (seed 0); then Muon at each of --muon-rates, with
AdamW for the embedding, the unembedding and the norms at the best AdamW rate (seed 0); then both
winners again with every other seed (training.seed: the initial weights; the batches are the
same). Each run is `python -m train` in a child process (AdamW alone is train.MUON emptied there,
the one-line edit README describes), evaluating every --eval-every steps on 8 validation batches.
The table gives each winner's final eval_loss per seed and the step at which Muon's eval_loss
first reaches AdamW's final one (linear between evaluations), as a fraction of the run's steps.
Runs already in --output with a final eval_loss are read, not run again. The default rates are
SWEEPS's, chosen so that each optimizer's best lies inside its sweep.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from seqax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per config: (AdamW's peak rates, Muon's), each three values around the best measured
# (docs/performance.md, "Muon against AdamW"); other configs take the first entry's.
SWEEPS = {"local_test_text": ([1e-3, 3e-3, 1e-2], [0.02, 0.05, 0.1]),
          "local_test_synthetic": ([3e-3, 1e-2, 3e-2], [0.02, 0.05, 0.1])}

# The child: `python -m bench.optimizers --child adamw|muon -- HYDRA_ARGS...`.
CHILD = """
import sys
import train
if sys.argv[1] == "adamw":
    train.MUON = {}  # the one-line edit that trains with AdamW alone
sys.argv = ["train", *sys.argv[2:]]
train.main()
"""


def run(config: str, optimizer: str, rate: float, adamw_rate: float, seed: int, steps: int, eval_every: int,
        output: str) -> list[tuple[int, float]]:
    """(step, eval_loss) of one run, every `eval_every` steps and at the end; runs it unless its
    metrics.jsonl already ends with the last evaluation."""
    name = f"{config}-{optimizer}-{rate:g}-adamw{adamw_rate:g}-seed{seed}"
    metrics = os.path.join(output, name, "metrics.jsonl")
    evals = read_evals(metrics)
    if not evals or evals[-1][0] != steps:
        overrides = [f"--config-path={os.path.join(ROOT, 'configs')}", f"--config-name={config}",
                     f"+paths.model_name={name}", f"paths.root_working_dir={output}",
                     f"training.learning_rate={adamw_rate}", f"training.muon_learning_rate={rate}",
                     f"training.seed={seed}", f"training.steps={steps}", f"eval_interval={eval_every}",
                     "eval_batches=8", "checkpoint_interval=0"]
        print(f"running {name}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c", CHILD, optimizer, *overrides], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        evals = read_evals(metrics)
    return evals


def read_evals(path: str) -> list[tuple[int, float]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return sorted({line["step"]: line["eval_loss"] for line in lines if "eval_loss" in line}.items())


def steps_to_reach(evals: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which eval_loss reaches `target`, linear between evaluations; None if never."""
    for (s0, l0), (s1, l1) in zip([(0, float("inf"))] + evals, evals):
        if l1 <= target:
            return s1 if l0 == float("inf") else s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return None


# The steps a config's rates were swept at where that is not its default: README's table is of 50 steps of
# local_test_synthetic, whose default run now trains 200.
SWEPT_STEPS = {"local_test_synthetic": 50}


def steps_of(config: str) -> int:
    return SWEPT_STEPS.get(config) or load_config(config, ["+paths.model_name=x"]).training.steps


def compare(config: str, args) -> dict:
    steps = steps_of(config)
    go = lambda optimizer, rate, adamw_rate, seed: run(config, optimizer, rate, adamw_rate, seed, steps,  # noqa: E731
                                                       args.eval_every, args.output)
    adamw_rates, muon_rates = SWEEPS.get(config, next(iter(SWEEPS.values())))
    adamw = {rate: go("adamw", rate, rate, args.seeds[0]) for rate in args.adamw_rates or adamw_rates}
    best_adamw = min(adamw, key=lambda rate: adamw[rate][-1][1])
    muon = {rate: go("muon", rate, best_adamw, args.seeds[0]) for rate in args.muon_rates or muon_rates}
    best_muon = min(muon, key=lambda rate: muon[rate][-1][1])
    seeds = {}
    for seed in args.seeds:
        a = adamw[best_adamw] if seed == args.seeds[0] else go("adamw", best_adamw, best_adamw, seed)
        m = muon[best_muon] if seed == args.seeds[0] else go("muon", best_muon, best_adamw, seed)
        seeds[seed] = {"adamw": a[-1][1], "muon": m[-1][1], "muon_steps_to_adamw_final": steps_to_reach(m, a[-1][1])}
    return {"config": config, "steps": steps, "best_adamw_rate": best_adamw, "best_muon_rate": best_muon,
            "sweep_adamw": {rate: evals[-1][1] for rate, evals in adamw.items()},
            "sweep_muon": {rate: evals[-1][1] for rate, evals in muon.items()}, "seeds": seeds}


def table(results: list[dict]) -> str:
    lines = ["| config | steps | AdamW rate (sweep: final eval_loss) | Muon rate (sweep) | seed "
             "| AdamW final eval_loss | Muon final eval_loss | Muon's steps to AdamW's final | as a fraction |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        sweep = lambda rates, best: ", ".join(f"{'**' if k == best else ''}{k:g}: {v:.4f}{'**' if k == best else ''}"  # noqa: E731
                                              for k, v in rates.items())
        for seed, s in r["seeds"].items():
            reach = s["muon_steps_to_adamw_final"]
            reached = ("not reached", "-") if reach is None else (f"{reach:.0f}", f"{reach / r['steps']:.2f}")
            lines.append(f"| {r['config']} | {r['steps']} | {sweep(r['sweep_adamw'], r['best_adamw_rate'])} | "
                         f"{sweep(r['sweep_muon'], r['best_muon_rate'])} | {seed} | {s['adamw']:.4f} | "
                         f"{s['muon']:.4f} | "
                         f"{reached[0]} | {reached[1]} |")
    fractions = [s["muon_steps_to_adamw_final"] / r["steps"] for r in results for s in r["seeds"].values()
                 if s["muon_steps_to_adamw_final"] is not None]
    if fractions:
        lines.append(f"\nMedian fraction of the steps Muon needs to reach AdamW's final eval_loss: "
                     f"{float(np.median(fractions)):.2f} ({len(fractions)} of "
                     f"{sum(len(r['seeds']) for r in results)} runs reached it)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["local_test_text", "local_test_synthetic"])
    parser.add_argument("--adamw-rates", nargs="+", type=float, help="AdamW's peak rates (default: SWEEPS's)")
    parser.add_argument("--muon-rates", nargs="+", type=float, help="Muon's peak rates (default: SWEEPS's)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--output", default=os.path.join("runs", "optimizers"), help="where the runs go")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    results = [compare(config, args) for config in args.config]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
