"""lm-evaluation-harness task configs for seqax's multiple-choice task files, so that `lm_eval` scores
an exported model (tools/export_hf.py) on the same examples as a run's evaluation does:

    .venv/bin/python -m tools.lm_eval_task text_choices.jsonl [more.jsonl ...] --output lm_eval_tasks
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/lm_eval --model hf \\
        --model_args pretrained=hf_model,dtype=float32 --include_path lm_eval_tasks --tasks text_choices \\
        --device cpu --batch_size 16

One YAML per file, named after it (text_choices.jsonl -> task `text_choices`): the JSONL itself as
the test split (the `json` dataset builder, no download), doc_to_text `context`, doc_to_choice
`choices`, doc_to_target `label`, output_type multiple_choice with acc and acc_norm, and
target_delimiter "" so that a choice is scored as written, as evaluation.py scores it.
"""

import argparse
import os

import yaml

from seqax.console import warn
from seqax.optional import INSTALL, installed


def task_config(path: str) -> dict:
    return {
        "task": os.path.basename(path).removesuffix(".jsonl"),
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": os.path.abspath(path)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", nargs="+", help="seqax task files (JSONL of context, choices, label)")
    parser.add_argument("--output", required=True, help="a directory for the YAML files (lm_eval --include_path)")
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    for path in args.tasks:
        if not os.path.isfile(path):
            raise SystemExit(f"tools.lm_eval_task: error: {path!r} is not a file")
        config = task_config(path)
        target = os.path.join(args.output, f"{config['task']}.yaml")
        with open(target, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        print(f"wrote {target}: lm_eval task {config['task']!r} over {os.path.abspath(path)}")
    if not installed("lm_eval"):
        warn(f"lm-evaluation-harness (`lm_eval`), which reads these tasks, is not installed: {INSTALL}")


if __name__ == "__main__":
    main()
