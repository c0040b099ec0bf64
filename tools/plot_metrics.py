"""Plots of one or several runs' metrics.jsonl against step, as one PNG: loss (train, and eval
where the run logged eval_loss), learning rate, grad norm, tokens/s, and the accuracy of each
multiple-choice task the runs evaluated (acc solid, acc_norm dashed; evaluation.py).

    .venv/bin/python -m tools.plot_metrics runs/a [runs/b ...] [--output plot.png]

A step logged twice (re-run after a crash, docs/design.md) is plotted with its last value. Needs
matplotlib (`make tools`).
"""

import argparse
import importlib
import json
import os
import sys

from seqax.config import SeqaxError
from seqax.optional import require
from seqax.outputs import check_output_apart

PANELS = [("loss", "loss"), ("learning_rate", "learning rate"), ("grad_norm", "grad norm"),
          ("tokens_per_second", "tokens/s")]


def read_metrics(run_dir: str) -> dict[str, dict[int, float]]:
    """{key: {step: value}} from run_dir/metrics.jsonl; later lines replace earlier ones."""
    series: dict[str, dict[int, float]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    series.setdefault(key, {})[record["step"]] = float(value)
    return series


def pyplot():
    require("matplotlib", "tools.plot_metrics").use("Agg")  # files only, no display
    return importlib.import_module("matplotlib.pyplot")


def plot(run_dirs: list[str], output: str):
    fig = figure(run_dirs)
    fig.savefig(output, dpi=100)
    pyplot().close(fig)


def figure(run_dirs: list[str]):
    """The runs' panels as a matplotlib Figure; the accuracy panel only where a run has task accuracies."""
    fig, grid = pyplot().subplots(2, 3, figsize=(18, 8), constrained_layout=True)
    axes, accuracy = grid.flat[[0, 1, 3, 4]], grid.flat[2]
    grid.flat[5].set_visible(False)
    for run_dir in run_dirs:
        series = read_metrics(run_dir)
        name = os.path.basename(os.path.normpath(run_dir))
        for key in sorted(k for k in series if k.endswith("/acc")):
            steps = sorted(series[key])
            (line,) = accuracy.plot(steps, [series[key][s] for s in steps], "o-", label=f"{name} {key}")
            norm = series.get(f"{key}_norm", {})
            accuracy.plot(sorted(norm), [norm[s] for s in sorted(norm)], "o--", color=line.get_color(),
                          label=f"{name} {key}_norm")
        for ax, (key, _) in zip(axes, PANELS):
            if key in series:
                steps = sorted(series[key])
                (line,) = ax.plot(steps, [series[key][s] for s in steps],
                                  label=name if key != "loss" else f"{name} train")
                if key == "loss" and "eval_loss" in series:
                    steps = sorted(series["eval_loss"])
                    ax.plot(steps, [series["eval_loss"][s] for s in steps], "o--", color=line.get_color(),
                            label=f"{name} eval")
    for ax, (_, title) in zip([*axes, accuracy], [*PANELS, ("", "multiple-choice tasks: accuracy")]):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    accuracy.set_visible(bool(accuracy.lines))  # no tasks: no empty panel
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--output", help="PNG to write (default: RUN_DIR/metrics.png of the first run)")
    args = parser.parse_args(argv)
    metrics = [os.path.join(run_dir, "metrics.jsonl") for run_dir in args.run_dirs]
    for run_dir, path in zip(args.run_dirs, metrics):
        if not os.path.exists(path):
            parser.error(f"{run_dir} has no metrics.jsonl")
    output = args.output or os.path.join(args.run_dirs[0], "metrics.png")
    try:
        check_output_apart(output, [(f"the metrics {m!r}", m) for m in metrics])
        plot(args.run_dirs, output)
    except SeqaxError as e:
        print(f"seqax: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
