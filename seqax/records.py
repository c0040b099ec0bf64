"""The records of a run in its run directory, and its lines on stdout: config.yaml; a line per
training step in metrics.jsonl, on stdout and in TensorBoard (loss, learning rate, grad norm, step
time, tokens/s, MFU, ETA); a line per evaluation; with logging.wandb_project set, the same values
and the config in Weights & Biases (wandb_log.py). It also runs the profiler's window (profiler.py),
which shares the step timing. Only process 0 prints and writes.

A step's scalars are read after the next step has been dispatched, so logging never makes the
device wait. A record that cannot be written (a full disk, no permission) stops the run with one
line naming the file (OutputError), where the loop is between steps and its checkpoints are
whole; after that, nothing more is written. (The profile is optional: profiler.py warns instead.)
"""

import array
import collections
import contextlib
import datetime
import glob
import json
import math
import os
import sys
import time

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils

from seqax import optional, run_lock, wandb_log
from seqax.analysis import hardware
from seqax.config import DivergedError, OutputError
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
Event, SessionLog = tensorboardX.proto.event_pb2.Event, tensorboardX.proto.event_pb2.SessionLog


class TensorBoardFile:
    """The TensorBoard events of one process start: one event file in `directory`, named with
    `suffix`, written from the caller's thread and flushed every FLUSH_SECONDS and at close(), so
    that a failed write (a full disk) raises where the loop can stop. (tensorboardX's SummaryWriter
    writes from a thread of its own, which a full disk ends with a traceback, after which the
    loop's next add_scalar waits for ever on the full queue.) `purge_step`: as SummaryWriter's,
    TensorBoard hides the events of earlier files at this step and after."""

    FLUSH_SECONDS = 10

    def __init__(self, directory: str, purge_step: int | None, suffix: str):
        os.makedirs(directory, exist_ok=True)
        self.events = tensorboardX.event_file_writer.EventsWriter(os.path.join(directory, "events"), suffix)
        self.path = glob.glob(os.path.join(directory, f"events.out.tfevents.*{suffix}"))[0]
        if purge_step is not None:
            self.events.write_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.events.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flushed = time.monotonic()

    def add_scalar(self, tag: str, value: float, step: int):
        summary = tensorboardX.summary.scalar(tag, value)
        self.events.write_event(Event(wall_time=time.time(), step=step, summary=summary))
        if time.monotonic() - self.flushed > self.FLUSH_SECONDS:
            self.events.flush()
            self.flushed = time.monotonic()

    def close(self):
        self.events.close()


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


def stop_if_diverged(step: int, values: dict):
    """A DivergedError when step `step`'s loss or gradient norm is not finite: the state it leads to
    must not be saved, and every later step would be NaN too (docs/reliability.md, "Divergence")."""
    if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
        raise DivergedError(f"step {step}'s loss is {values['loss']} and its grad_norm {values['grad_norm']}: "
                            "training diverged, and stops before saving a state past it", step)


def parsed(line: str) -> dict:
    """A metrics.jsonl line as a dict; {} for one that is not a JSON object (edited by hand, say)."""
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def missing_evaluations(metrics_path: str, steps: list[int]) -> list[int]:
    """Those of `steps` (the same list on every process) whose evaluation line the run's metrics.jsonl
    lacks: process 0 reads the file, and every process gets its answer."""
    if jax.process_index() == 0:
        evaluated = set()
        if os.path.exists(metrics_path):
            with open(metrics_path, errors="replace") as f:  # a line of bytes not UTF-8 is no JSON
                evaluated = {line.get("step") for line in map(parsed, f) if "eval_time" in line}
        missing = np.array([step not in evaluated for step in steps])
    else:
        missing = np.zeros(len(steps), bool)
    if jax.process_count() > 1 and steps:
        missing = multihost_utils.broadcast_one_to_all(missing)
    return [step for step, m in zip(steps, missing) if m]


def resumed(run_dir: str, checkpoint_dir: str, step: int, steps: int, evaluations_due: list[int]) -> bool:
    """Says that the run resumes from checkpoint `step` (in `checkpoint_dir`), when it was written and
    what is left of the run's `steps`; or, when nothing is left (no step, and every evaluation of
    `evaluations_due` in metrics.jsonl), says so and returns True: the run stops before compiling."""
    if step >= steps and not missing_evaluations(os.path.join(run_dir, "metrics.jsonl"), evaluations_due):
        if jax.process_index() == 0:
            print(f"run complete at step {step}: nothing to do (training.steps={steps})", flush=True)
        return True
    if jax.process_index() == 0:
        written = os.path.getmtime(os.path.join(checkpoint_dir, "zarr.json"))  # the commit rewrites it
        left = f"steps {step}-{steps - 1} to go" if step < steps else "its evaluation to finish"
        print(f"resumed from checkpoint {step} (written {datetime.datetime.fromtimestamp(written):%Y-%m-%d %H:%M:%S}, "
              f"{_duration(time.time() - written)} ago): {left}", flush=True)
    return False


class RunRecords:
    """Everything a run records besides checkpoints and start-up reports. `cfg` is the run's
    config.Config; the run starts (or resumes) at step `start`; a token costs `flops_per_token`
    model FLOPs (train.model_flops_per_token: MFU's numerator); the profiler traces cfg.profile_steps
    steps after the first. Only process 0 prints and writes.

    A step's line is written when the next step has been dispatched (after_step), so that reading
    its scalars never stalls the device; flush() writes the step still held back (before a
    checkpoint commits), and eval() and close() flush first, so lines stay in step order."""

    def __init__(self, run_dir: str, resolved_yaml: str, cfg, start: int, flops_per_token: float):
        self.run_dir, self.cfg = run_dir, cfg
        self.writes = jax.process_index() == 0
        self.tokens_per_step = cfg.training.tokens.batch * cfg.training.tokens.len
        self.model_flops_per_token = flops_per_token
        self.held_back = None  # (step, metrics) of the last dispatched step, not yet written
        self.profile = ProfileWindow(os.path.join(run_dir, "profile"),
                                     steps_to_profile(start, cfg.training.steps, cfg.profile_steps) if self.writes
                                     else range(0))
        self.recent_step_times = collections.deque(maxlen=20)
        self.step_times = array.array("d")  # every step's of this process start after its first (which warms up)
        self.moe = cfg.model.experts > 0  # expert_load is logged for a mixture of experts only
        # A step's time runs from when it can start (its dispatch, or the end of the step before
        # if that is later) to when it ends (its scalars are read, or the profiler waited for it),
        # so host work between steps (evaluation, a checkpoint's copy, the profile) is not in it.
        self.dispatched: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.last_end, self.wandb = 0.0, None
        self.metrics_file = self.tensorboard = None
        self.failed = False  # a write failed: nothing more is written
        if not self.writes:
            return
        with self.writing(run_dir):
            os.makedirs(run_dir, exist_ok=True)
        self.lock = run_lock.lock_identity(run_dir)  # the lock the run holds (train.py took it before): watched
        with self.writing(os.path.join(run_dir, "config.yaml")) as path, open(path, "w") as f:
            f.write(resolved_yaml)
        with self.writing(os.path.join(run_dir, "metrics.jsonl")) as path:
            self.metrics_file = open_lines_for_append(path)
        # One event file per process start (the suffix keeps two starts in one second apart).
        # On resume, purge_step hides the events of steps >= start that an earlier process wrote
        # after its last checkpoint: TensorBoard shows each step once, with the values of the
        # run that continued (metrics.jsonl keeps both lines).
        with self.writing(os.path.join(run_dir, "tensorboard")) as path:
            self.tensorboard = TensorBoardFile(path, start or None, f".step{start}.pid{os.getpid()}")
            if not optional.installed("tensorboard"):
                self.print(f"TensorBoard events in {path}; its viewer is not installed: {optional.INSTALL}")
        with self.writing(os.path.join(run_dir, wandb_log.RUN_ID_FILE)):
            self.wandb = (WandbLog(run_dir, cfg.logging, yaml.safe_load(resolved_yaml)) if cfg.logging.wandb_project
                          else None)
        self.peak, source = hardware.peak_flops()
        # On CPU the peak is measured, so it is only the best rate seen: a step faster than that raises it.
        self.peak_is_measured, self.announced_peak = jax.devices()[0].platform == "cpu", self.peak
        self.print(f"MFU against {self.peak / 1e12:.3g} TFLOP/s: {source}" if self.peak
                   else f"MFU is null: no peak FLOP/s known for {source}")

    def print(self, text: str):
        if self.writes:
            print(text, flush=True)

    @contextlib.contextmanager
    def writing(self, path: str):
        """A block that writes `path` (given to it): its OSError (a full disk, no permission) is an
        OutputError naming the file, and every later write of these records is skipped."""
        try:
            yield path
        except OSError as e:
            self.failed = True
            where = e.filename if isinstance(e.filename, str) and e.filename.startswith(self.run_dir) else path
            raise OutputError(f"cannot write {where}: {e.strerror or e}; the run stops here, its checkpoints "
                              "intact: free space (or fix the permission) and run the same command again to "
                              "resume from the newest checkpoint") from None

    def missing_evaluations(self, steps: list[int]) -> list[int]:
        """Those of `steps` whose evaluation line metrics.jsonl lacks (missing_evaluations)."""
        return missing_evaluations(os.path.join(self.run_dir, "metrics.jsonl"), steps)

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
        held, self.held_back = self.held_back, None  # written once, even when its line stops the run
        if held is not None:
            self.write_step(*held)

    def write_step(self, step: int, metrics):
        """Reads the step's scalars (waiting for that step only) and writes its line."""
        values = {k: float(v) for k, v in jax.device_get(vars(metrics)).items() if self.moe or k != "expert_load"}
        end = self.finished.pop(step, time.perf_counter())
        step_time = max(end - max(self.last_end, self.dispatched.pop(step, end)), 1e-9)
        first, self.last_end = not self.last_end, end
        if not self.writes or self.failed:
            stop_if_diverged(step, values)
            return
        if self.lock is not None:
            run_lock.check_in_place(self.run_dir, self.lock)
        self.recent_step_times.append(step_time)
        if not first:
            self.step_times.append(step_time)
        tokens_per_second = self.tokens_per_step / step_time
        model_flops = self.model_flops_per_token * tokens_per_second
        if self.peak_is_measured and self.peak and model_flops > self.peak:
            self.raise_peak(step, model_flops)
        mfu = model_flops / self.peak if self.peak else None
        line = {"step": step, **values, "step_time": step_time, "tokens_per_second": tokens_per_second, "mfu": mfu}
        self.write_line(line)
        with self.writing(self.tensorboard.path):
            for key, value in line.items():
                if key != "step" and value is not None:
                    self.tensorboard.add_scalar(key if key in values else f"perf/{key}", value, step)
        eta = _duration(float(np.mean(self.recent_step_times)) * (self.cfg.training.steps - step - 1))
        load = f"  expert_load {values['expert_load']:.3g}" if self.moe else ""
        print(f"step {step:6d}/{self.cfg.training.steps}  loss {values['loss']:.4f}  lr {values['learning_rate']:.3g}  "
              f"grad_norm {values['grad_norm']:.3g}{load}  {step_time * 1000:.0f} ms  {tokens_per_second:.0f} tok/s  "
              f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}  ETA {eta}", flush=True)
        stop_if_diverged(step, values)

    def raise_peak(self, step: int, model_flops: float):
        """A step ran the model's FLOPs faster than the measured peak (the CPU was busier at the
        measurement): that rate is the peak from now on, so that MFU stays at most 100%. Said in a
        line when it has grown by more than a tenth since the last one said."""
        self.peak = model_flops
        kept = hardware.keep_cpu_peak(model_flops / jax.process_count(),
                                      f"fastest training step ({os.path.basename(self.run_dir)}, step {step})")
        if model_flops > 1.1 * self.announced_peak:
            print(f"MFU's peak raised to {model_flops / 1e12:.4g} TFLOP/s: step {step} ran the model's FLOPs "
                  f"faster than the {self.announced_peak / 1e12:.4g} measured before (the CPU was busier then); "
                  f"MFU is against the best rate seen, {kept}", flush=True)
            self.announced_peak = model_flops

    def write_line(self, line: dict):
        """A line of metrics.jsonl, and the same values to W&B when it is on."""
        with self.writing(self.metrics_file.name):
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
        if not self.writes or self.failed:
            return
        self.write_line({"step": step, **metrics})
        with self.writing(self.tensorboard.path):
            for key, value in metrics.items():
                self.tensorboard.add_scalar(f"perf/{key}" if key == "eval_time" else key, value, step)
        shown = "  ".join(f"{key} {value:.4f}" for key, value in metrics.items() if key != "eval_time")
        steps = (f" = {metrics['eval_time'] / float(np.median(self.recent_step_times)):.1f} training steps"
                 if self.recent_step_times else "")
        self.print(f"eval {step:6d}/{self.cfg.training.steps}  {shown}  ({metrics['eval_time']:.2f} s{steps})")

    def print_summary(self):
        """The line that compares runs: the median step after the first (which warms up) of this process
        start, with its tokens/s and MFU, each step's line being as noisy as the machine is busy."""
        if not self.step_times or self.failed:
            return
        median = float(np.median(self.step_times))
        tokens_per_second = self.tokens_per_step / median
        mfu = f"{self.model_flops_per_token * tokens_per_second / self.peak:.1%}" if self.peak else "n/a"
        self.print(f"median of {len(self.step_times)} steps after the first: {median * 1000:.0f} ms, "
                   f"{tokens_per_second:.0f} tok/s, MFU {mfu}")

    def close(self, quietly: bool = False):
        """Flushes and closes every record. A write that fails here is an OutputError, unless the
        run is already stopping for an error (`quietly`, or a write of these records failed): that
        error is the one the user needs to see."""
        unless_quiet = contextlib.suppress(OutputError) if quietly or self.failed else contextlib.nullcontext()
        with unless_quiet:
            self.flush()
        if not quietly:
            self.print_summary()
        self.profile.close()  # the run stopped inside the profiled steps
        for path, writer in ((getattr(self.tensorboard, "path", ""), self.tensorboard),
                             (getattr(self.metrics_file, "name", ""), self.metrics_file)):
            with unless_quiet, self.writing(path):
                if writer is not None:
                    writer.close()  # flushes what it holds: after a failure, what still fits
        if self.wandb is not None:
            self.wandb.close()

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback):
        self.close(quietly=error is not None)
