"""The records of a run in its run directory, and its lines on stdout: config.yaml; a line per
training step in metrics.jsonl, on stdout and in TensorBoard (loss, learning rate, grad norm, step
time, tokens/s, MFU, ETA); a line per evaluation; with logging.wandb_project set, the same values
and the config in Weights & Biases (wandb_log.py). It also runs the profiler's window (profiler.py),
which shares the step timing. Only process 0 prints and writes.

A step's scalars are read after the next step has been dispatched, so logging never makes the
device wait.
"""

import collections
import datetime
import json
import os
import sys
import time

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils

from seqax import hardware
from seqax.profiler import ProfileWindow, steps_to_profile
from seqax.wandb_log import WandbLog


def import_tensorboardx():
    """tensorboardX imports torch whenever torch is installed, only to accept torch tensors: 2-3 s
    of every run's start-up where it is (the test environment, many researchers' machines). We
    log Python floats, so unless torch is already loaded, tensorboardX is imported with torch
    hidden (a module set to None in sys.modules fails to import, which tensorboardX expects);
    torch imports as usual afterwards."""
    if "torch" in sys.modules:
        import tensorboardX
        return tensorboardX
    sys.modules["torch"] = None
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


tensorboardX = import_tensorboardx()


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def open_lines_for_append(path: str):
    """Opens a file of lines for appending, first dropping a torn last line (a process killed
    while writing it). Its step is re-run on resume: the loop logs step N-1 before it saves
    checkpoint N, so a step whose line was cut is never in the checkpoint the run resumes from."""
    if os.path.exists(path):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a")


def parsed(line: str) -> dict:
    """A metrics.jsonl line as a dict; {} for one that is not a JSON object (edited by hand, say)."""
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class RunRecords:
    """Everything a run records besides checkpoints and start-up reports. `cfg` is the run's
    config.Config; the run starts (or resumes) at step `start`; a token costs `flops_per_token`
    model FLOPs (train.model_flops_per_token: MFU's numerator); the profiler traces `profiled_steps`
    steps after the first. Only process 0 prints and writes.

    A step's line is written when the next step has been dispatched (after_step), so that reading
    its scalars never stalls the device; flush() writes the step still held back (before a
    checkpoint commits), and eval() and close() flush first, so lines stay in step order."""

    def __init__(self, run_dir: str, resolved_yaml: str, cfg, start: int, flops_per_token: float,
                 profiled_steps: int = 2):
        self.run_dir, self.cfg = run_dir, cfg
        self.writes = jax.process_index() == 0
        self.tokens_per_step = cfg.training.tokens.batch * cfg.training.tokens.len
        self.model_flops_per_token = flops_per_token
        self.held_back = None  # (step, metrics) of the last dispatched step, not yet written
        self.profile = ProfileWindow(os.path.join(run_dir, "profile"),
                                     steps_to_profile(start, cfg.training.steps, profiled_steps) if self.writes
                                     else range(0))
        self.recent_step_times = collections.deque(maxlen=20)
        # A step's time runs from when it can start (its dispatch, or the end of the step before
        # if that is later) to when it ends (its scalars are read, or the profiler waited for it),
        # so host work between steps (evaluation, a checkpoint's copy, the profile) is not in it.
        self.dispatched: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.last_end, self.wandb = 0.0, None
        if not self.writes:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(resolved_yaml)
        self.metrics_file = open_lines_for_append(os.path.join(run_dir, "metrics.jsonl"))
        # One event file per process start (the suffix keeps two starts in one second apart).
        # On resume, purge_step hides the events of steps >= start that an earlier process wrote
        # after its last checkpoint: TensorBoard shows each step once, with the values of the
        # run that continued (metrics.jsonl keeps both lines).
        self.tensorboard = tensorboardX.SummaryWriter(
            os.path.join(run_dir, "tensorboard"), purge_step=start or None, flush_secs=10,
            filename_suffix=f".step{start}.pid{os.getpid()}")
        self.wandb = (WandbLog(run_dir, cfg.logging, yaml.safe_load(resolved_yaml)) if cfg.logging.wandb_project
                      else None)
        self.peak, source = hardware.peak_flops()
        self.print(f"peak bf16 FLOP/s for MFU: {source}: "
                   + (f"{self.peak / 1e12:.4g} TFLOP/s" if self.peak else "unknown, MFU is null"))

    def print(self, text: str):
        if self.writes:
            print(text, flush=True)

    def missing_evaluations(self, steps: list[int]) -> list[int]:
        """Those of `steps` (the same list on every process) whose evaluation line metrics.jsonl lacks:
        process 0 reads the file, and every process gets its answer."""
        if self.writes:
            with open(self.metrics_file.name) as f:
                evaluated = {line.get("step") for line in map(parsed, f) if "eval_time" in line}
            missing = np.array([step not in evaluated for step in steps])
        else:
            missing = np.zeros(len(steps), bool)
        if jax.process_count() > 1 and steps:
            missing = multihost_utils.broadcast_one_to_all(missing)
        return [step for step, m in zip(steps, missing) if m]

    # --- the loop

    def before_step(self, step: int, state):
        """Call before dispatching `step` (the profiler's trace starts before its first step)."""
        self.profile.before_step(step, state)
        self.dispatched[step] = time.perf_counter()

    def after_step(self, step: int, metrics):
        """Call after dispatching `step`: writes the line of the step before and holds this one back
        (the profiler's trace stops once its last step is done, which then ends that step's time)."""
        self.flush()
        self.held_back = (step, metrics)
        finished = self.profile.after_step(step, metrics)
        if finished is not None:
            self.finished[step] = finished

    def flush(self):
        """Writes the line of the step held back, if any."""
        if self.held_back is not None:
            self.write_step(*self.held_back)
            self.held_back = None

    def write_step(self, step: int, metrics):
        """Reads the step's scalars (waiting for that step only) and writes its line."""
        values = {k: float(v) for k, v in jax.device_get(vars(metrics)).items()}
        end = self.finished.pop(step, time.perf_counter())
        step_time = max(end - max(self.last_end, self.dispatched.pop(step, end)), 1e-9)
        self.last_end = end
        if not self.writes:
            return
        self.recent_step_times.append(step_time)
        tokens_per_second = self.tokens_per_step / step_time
        mfu = self.model_flops_per_token * tokens_per_second / self.peak if self.peak else None
        line = {"step": step, **values, "step_time": step_time, "tokens_per_second": tokens_per_second, "mfu": mfu}
        self.write_line(line)
        for key, value in line.items():
            if key != "step" and value is not None:
                self.tensorboard.add_scalar(key if key in values else f"perf/{key}", value, step)
        eta = _duration(float(np.mean(self.recent_step_times)) * (self.cfg.training.steps - step - 1))
        print(f"step {step:6d}/{self.cfg.training.steps}  loss {values['loss']:.4f}  lr {values['learning_rate']:.3g}  "
              f"grad_norm {values['grad_norm']:.3g}  {step_time * 1000:.0f} ms  {tokens_per_second:.0f} tok/s  "
              f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}  ETA {eta}", flush=True)

    def write_line(self, line: dict):
        """A line of metrics.jsonl, and the same values to W&B when it is on."""
        self.metrics_file.write(json.dumps(line) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log(line)

    def eval(self, step: int, evaluate, token_losses):
        """Runs `evaluate(token_losses) -> {"eval_loss": ..., "TASK/acc": ..., "TASK/acc_norm": ...}`
        (evaluation.Evaluation, with `token_losses(targets, is_seq_start)` of the weights after `step`
        steps, those of checkpoint `step`) and writes the line {"step": step, ..., "eval_time": seconds}
        to metrics.jsonl, TensorBoard and stdout, which also gives the time in training steps. The step
        before is logged first, so that its time does not include this."""
        self.flush()
        started = time.perf_counter()
        metrics = {**evaluate(token_losses), "eval_time": 0.0}
        metrics["eval_time"] = time.perf_counter() - started
        if not self.writes:
            return
        self.write_line({"step": step, **metrics})
        for key, value in metrics.items():
            self.tensorboard.add_scalar(f"perf/{key}" if key == "eval_time" else key, value, step)
        shown = "  ".join(f"{key} {value:.4f}" for key, value in metrics.items() if key != "eval_time")
        steps = (f" = {metrics['eval_time'] / float(np.median(self.recent_step_times)):.1f} training steps"
                 if self.recent_step_times else "")
        self.print(f"eval {step:6d}/{self.cfg.training.steps}  {shown}  ({metrics['eval_time']:.2f} s{steps})")

    def close(self):
        self.flush()
        self.profile.close()  # the run stopped inside the profiled steps
        if not self.writes:
            return
        self.tensorboard.close()
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.close()
