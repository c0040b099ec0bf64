"""Weights & Biases for a run, when `logging.wandb_project` is set: the values of every line
records.RunRecords writes to metrics.jsonl (step lines and eval lines), at that line's step as
the W&B step, and the run's resolved config. wandb is imported only then.

One W&B run per run directory: its id is drawn at the first start and kept in the run
directory's `wandb_run_id`, and every restart resumes it (resume="allow"). W&B keeps a run's
steps increasing, so the steps that a restart runs again (those after the checkpoint it resumes
from) keep their first values there; metrics.jsonl has both lines. The W&B files go to
$WANDB_DIR if set, else the run directory (its wandb/); WANDB_MODE=offline writes without a
network, for `wandb sync` later.
"""

import os
import uuid

from seqax.config import ConfigError

RUN_ID_FILE = "wandb_run_id"


def run_id(run_dir: str) -> str:
    """The W&B run id of `run_dir`: the one stored there, else a new one, stored atomically."""
    path = os.path.join(run_dir, RUN_ID_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    new = uuid.uuid4().hex[:16]
    with open(path + ".tmp", "w") as f:
        f.write(new + "\n")
    os.replace(path + ".tmp", path)
    return new


class WandbLog:
    def __init__(self, run_dir: str, logging_cfg, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb_project is set but wandb is not installed: "
                              ".venv/bin/pip install -r requirements.txt") from None
        try:
            self.run = wandb.init(project=logging_cfg.wandb_project, entity=logging_cfg.wandb_entity or None,
                                  id=run_id(run_dir), resume="allow", name=os.path.basename(os.path.normpath(run_dir)),
                                  config=config, dir=os.environ.get("WANDB_DIR") or run_dir)
        except Exception as e:  # wandb raises its own kinds (no API key, no network, a bad entity)
            message = " ".join(str(e).split())
            raise ConfigError(f"W&B could not start a run for logging.wandb_project={logging_cfg.wandb_project!r}: "
                              f"{message}; log in (`wandb login`), set WANDB_MODE=offline, "
                              "or set logging.wandb_project to \"\" to turn W&B off") from None

    def log(self, line: dict):
        """One metrics.jsonl line: {"step": int, name: value, ...}."""
        self.run.log({k: v for k, v in line.items() if k != "step"}, step=line["step"])

    def close(self):
        import wandb

        self.run.finish()
        wandb.teardown()  # stops W&B's service process and threads: the run's process is ending
