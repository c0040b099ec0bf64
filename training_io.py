"""What a run writes besides checkpoints: config.yaml, metrics.jsonl and the console lines."""

import json
import os
import time

import jax


class RunLog:
    """One line per step to stdout and to <run_dir>/metrics.jsonl (appended on resume)."""

    def __init__(self, run_dir: str, resolved_yaml: str, tokens_per_step: int):
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(resolved_yaml)
        self.metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.tokens_per_step = tokens_per_step
        self.last_time = time.perf_counter()

    def step(self, step: int, metrics):
        """Reads the step's scalars (waiting for that step only) and writes its line."""
        values = {k: float(v) for k, v in jax.device_get(vars(metrics)).items()}
        now = time.perf_counter()
        step_time, self.last_time = now - self.last_time, now
        line = {"step": step, **values, "step_time": step_time, "tokens_per_second": self.tokens_per_step / step_time}
        self.metrics_file.write(json.dumps(line) + "\n")
        self.metrics_file.flush()
        print(f"step {step:6d}  loss {values['loss']:.4f}  lr {values['learning_rate']:.3g}  grad_norm {values['grad_norm']:.3g}  "
              f"{step_time * 1000:.0f} ms  {line['tokens_per_second']:.0f} tok/s", flush=True)

    def close(self):
        self.metrics_file.close()
