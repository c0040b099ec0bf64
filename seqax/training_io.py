"""What a run tells the researcher besides checkpoints, all in its run directory:
config.yaml; one line per step on stdout, in metrics.jsonl and in TensorBoard (loss, learning
rate, grad norm, tokens/s, MFU, step time, ETA); at start-up the compile time, the model FLOPs
against XLA's count, a memory report (memory_report.txt) and a communication report
(communication_report.txt); the optimized HLO of the step
(training_step.hlo.txt, .dot and .svg); a profiler trace of two steps (profile/). With
logging.wandb_project set, metrics.jsonl's values and the config go to W&B too (wandb_log.py).

Only process 0 prints and writes. Logging reads the step's three scalars after the next step is
dispatched, so it never makes the device wait.
"""

import collections
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from seqax import communication, hlo_graph, memory
from seqax.wandb_log import WandbLog


def _import_tensorboardx():
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


tensorboardX = _import_tensorboardx()

# ---------------------------------------------------------------------------------------------
# FLOPs and peak rates. The model's FLOPs per token are train.model_flops_per_token, passed in.


# Peak dense bfloat16 matmul rate per device, by jax.Device.device_kind (first full match).
# Vendors quote "with sparsity" figures for NVIDIA parts: the dense rate is half of those.
PEAK_BF16_FLOPS = [
    # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), SXM and PCIe.
    (r"NVIDIA A100.*", 312e12),
    # NVIDIA H100 datasheet: BF16 1,979 (SXM) / 1,671 (NVL) / 1,513 (PCIe) TFLOPS with sparsity.
    (r"NVIDIA H100.*PCIe.*", 756e12),
    (r"NVIDIA H100.*NVL.*", 835e12),
    (r"NVIDIA H100.*", 989e12),
    # NVIDIA H200 datasheet: BF16 1,979 (SXM) / 1,671 (NVL) TFLOPS with sparsity.
    (r"NVIDIA H200.*NVL.*", 835e12),
    (r"NVIDIA H200.*", 989e12),
    # NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS per GPU with sparsity.
    (r"NVIDIA B200.*", 2250e12),
    # Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e):
    # peak bf16 TFLOPS per chip. JAX names v5e "TPU v5 lite", v5p "TPU v5", v6e "TPU v6 lite".
    (r"TPU v4", 275e12),
    (r"TPU v5 lite|TPU v5e", 197e12),
    (r"TPU v5p?", 459e12),
    (r"TPU v6 lite|TPU v6e", 918e12),
]


def peak_bf16_flops_per_device(device_kind: str) -> float | None:
    return next((peak for pattern, peak in PEAK_BF16_FLOPS if re.fullmatch(pattern, device_kind)), None)


def measure_cpu_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """The bf16 x bf16 -> f32 matmul rate of the whole machine (FLOP/s, median), the
    denominator of CPU MFU: every local device multiplies its own n x n matrices at once, as in
    training, so simulated devices that share cores are measured sharing them. It is the rate of
    the matmuls the model does; on some CPUs f32 x f32 is faster (docs/observability.md)."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))
    # From host memory: jnp.ones would follow the caller's mesh, which spans other processes.
    a = jax.device_put(np.ones((len(devices) * n, n), jnp.bfloat16), sharding)
    matmul = jax.shard_map(lambda x: jnp.matmul(x, x[:n].T, preferred_element_type=jnp.float32), mesh=mesh,
                           in_specs=jax.sharding.PartitionSpec("all"), out_specs=jax.sharding.PartitionSpec("all"))
    f = jax.jit(matmul)
    times = []
    with jax.set_mesh(mesh):  # its own mesh, whatever mesh the caller has set
        f(a).block_until_ready()
        for _ in range(repeats):
            start = time.perf_counter()
            f(a).block_until_ready()
            times.append(time.perf_counter() - start)
    return len(devices) * 2 * n**3 / float(np.median(times))


def peak_flops() -> tuple[float | None, str]:
    """Peak bf16 FLOP/s of all devices of the run and where the number comes from. On CPU it is
    measured (each process measures its machine); an unknown accelerator gives None and one
    warning, never a guess."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        rate = measure_cpu_matmul_flops() * jax.process_count()
        return rate, f"measured bf16->f32 matmul rate of {jax.process_count()} CPU machine(s)"
    per_device = peak_bf16_flops_per_device(device.device_kind)
    if per_device is None:
        warn(f"no peak bf16 FLOP/s known for device kind {device.device_kind!r}: MFU is logged as null; "
             "add the device to training_io.PEAK_BF16_FLOPS")
        return None, f"unknown ({device.device_kind})"
    return (per_device * jax.device_count(),
            f"{jax.device_count()} x {device.device_kind} at {per_device / 1e12:.0f} TFLOP/s")


def flops_check(compiled, cfg, flops_per_token, optimizer_flops) -> str:
    """The model's FLOPs per step (`flops_per_token(model config, seq_len)` times the tokens), the
    optimizer's (`optimizer_flops(model config, devices)`: in all and on the busiest device) and
    XLA's count for the compiled step of the run's config `cfg`, as a line of text.

    XLA's cost_analysis() counts the body of a while loop once, not once per iteration (on jax
    0.10.2 local_test_synthetic on one device counts 30.4, 30.6 and 30.7 GFLOP per step for 1, 2 and
    4 layers, where the model has 30.0, 51.9 and 95.8). So the layer scan counts as one layer, and
    the comparable number is the model's with layers=1 plus the optimizer's on every device (both
    ratios are printed, in case a later XLA multiplies by the trip count). XLA counts a little more
    than that: the full L x L score matmuls where MFU takes the causal half, QK^T recomputed in the
    backward pass, and elementwise work, 1 FLOP per element per operation (docs/observability.md)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    devices = jax.device_count()
    xla = float(cost.get("flops", 0.0)) * devices if cost else 0.0
    seq_len, tokens_per_step = cfg.training.tokens.len, cfg.training.tokens.batch * cfg.training.tokens.len
    formula = flops_per_token(cfg.model, seq_len) * tokens_per_step
    one_layer = flops_per_token(dataclasses.replace(cfg.model, layers=1), seq_len) * tokens_per_step
    optimizer, busiest = optimizer_flops(cfg.model, devices)
    line = (f"FLOPs per step: model {formula / 1e9:.4g} GFLOP ({one_layer / 1e9:.4g} with one layer); optimizer "
            f"(Newton-Schulz) {optimizer / 1e9:.4g} GFLOP = {optimizer / formula:.1%} of the model's, "
            f"{busiest / 1e9:.4g} on the busiest of {devices} devices")
    if not xla:
        return line + "; XLA gives no cost analysis on this backend"
    return line + (f"; XLA cost_analysis {xla / 1e9:.4g} GFLOP = {xla / (formula + busiest * devices):.3f} x model "
                   f"+ optimizer, {xla / (one_layer + busiest * devices):.3f} x that with one layer "
                   "(XLA counts a loop body once)")


# ---------------------------------------------------------------------------------------------
# The run log.


def compile_step(training_step, cfg, state, mesh):
    """`training_step(state, step, targets, is_seq_start, loss_mask, cfg)` (train.py's) compiled
    ahead of time for this state (arrays or ShapeDtypeStructs) and batches of the config's shape
    split over d and c, as the loader makes them, so that a run reports its compile time, FLOPs
    and memory before the first step; the loop runs it."""
    shape = (cfg.training.tokens.batch, cfg.training.tokens.len)
    sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("d", "c"))
    batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for dtype in (jnp.uint32, jnp.bool_, jnp.bool_)]
    return training_step.lower(state, jnp.uint32(0), *batch, cfg).compile()


def is_due(interval: int, done: int, steps: int) -> bool:
    """Whether something that runs every `interval` steps (0: only at the end) runs after `done` steps."""
    return done == steps or (interval > 0 and done % interval == 0)


def warn(message: str):
    print(f"seqax: warning: {message}", file=sys.stderr, flush=True)


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


DOT_WAIT_SECONDS = 30  # how long the end of a run waits for graphviz, which started at compile time


class RunLog:
    """Everything a run prints and writes besides checkpoints. `cfg` is the run's config.Config;
    the run starts (or resumes) at step `start`; `flops_per_token(model config, seq_len)` counts
    the model's FLOPs (train.model_flops_per_token) and `optimizer_flops(model config, devices)` the
    optimizer's per step, in all and on the busiest device (train.newton_schulz_flops); the profiler
    traces `profiled_steps` steps after the first. Only process 0 prints and writes.

    A step's line is written when the next step has been dispatched (after_step), so that reading
    its scalars never stalls the device; flush() writes the step still held back (before a
    checkpoint commits), and eval() and close() flush first, so lines stay in step order."""

    def __init__(self, run_dir: str, resolved_yaml: str, cfg, start: int, flops_per_token, optimizer_flops,
                 profiled_steps: int = 2):
        self.run_dir, self.cfg = run_dir, cfg
        self.flops_per_token, self.optimizer_flops = flops_per_token, optimizer_flops
        self.writes = jax.process_index() == 0
        self.tokens_per_step = cfg.training.tokens.batch * cfg.training.tokens.len
        self.model_flops_per_token = flops_per_token(cfg.model, cfg.training.tokens.len)
        self.held_back = None  # (step, metrics) of the last dispatched step, not yet written
        # The first step after the first one of this process, so that nothing waits for a compile.
        self.profiled = (range(start + 1, min(start + 1 + profiled_steps, cfg.training.steps)) if self.writes
                         else range(0))
        self.recent_step_times = collections.deque(maxlen=20)
        # A step's time runs from when it can start (its dispatch, or the end of the step before
        # if that is later) to when it ends (its scalars are read, or the profiler waited for it),
        # so host work between steps (evaluation, a checkpoint's copy, the profile) is not in it.
        self.dispatched: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.last_end, self.dot_process, self.tracing, self.wandb = 0.0, None, False, None
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
        self.tensorboard = tensorboardX.SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start or None,
                                                      flush_secs=10, filename_suffix=f".step{start}.pid{os.getpid()}")
        self.wandb = (WandbLog(run_dir, cfg.logging, yaml.safe_load(resolved_yaml)) if cfg.logging.wandb_project
                      else None)
        self.peak, source = peak_flops()
        self.print(f"peak bf16 FLOP/s for MFU: {source}: "
                   + (f"{self.peak / 1e12:.4g} TFLOP/s" if self.peak else "unknown, MFU is null"))

    def print(self, text: str):
        if self.writes:
            print(text, flush=True)

    def write(self, name: str, text: str):
        if self.writes:
            with open(os.path.join(self.run_dir, name), "w") as f:
                f.write(text)

    # --- start-up: compile, FLOPs, HLO graph, memory

    def compile(self, lower_and_compile):
        """Runs `lower_and_compile()` (returns a jax Compiled), prints the compile time and the
        FLOPs check, and writes the optimized HLO with its graph."""
        started = time.perf_counter()
        compiled = lower_and_compile()
        self.print(f"compiled the training step in {time.perf_counter() - started:.1f} s")
        self.print(flops_check(compiled, self.cfg, self.flops_per_token, self.optimizer_flops))
        if self.writes:
            self._write_hlo(compiled.as_text())
        return compiled

    def _write_hlo(self, hlo_text: str):
        path = lambda suffix: os.path.join(self.run_dir, f"training_step.{suffix}")  # noqa: E731
        self.write("training_step.hlo.txt", hlo_text)
        try:
            graph = hlo_graph.to_dot(hlo_text, "training_step")
        except Exception as e:  # a picture must not stop a run, e.g. if a new XLA prints HLO differently
            warn(f"could not draw the HLO graph of training_step.hlo.txt: {e!r}")
            return
        self.write("training_step.dot", graph)
        if shutil.which("dot") is None:
            warn("graphviz's `dot` is not installed, so there is no training_step.svg (training_step.dot is written); "
                 "install it with `apt-get install graphviz` (Debian/Ubuntu) or `brew install graphviz`")
            return
        # Rendered in the background at the lowest priority, so that it takes no CPU from the
        # steps (on a 2-core machine it held one core for 15-30 s of the first steps); close()
        # waits for it, when the steps no longer need the CPU.
        self.dot_process = subprocess.Popen(["dot", "-Tsvg", path("dot"), "-o", path("svg")],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            os.setpriority(os.PRIO_PROCESS, self.dot_process.pid, 19)
        except ProcessLookupError:  # it has already finished
            pass

    def mesh_title(self) -> str:
        """The reports' title: the mesh and the devices."""
        return (f"mesh d={self.cfg.mesh.d} t={self.cfg.mesh.t} c={self.cfg.mesh.c}, "
                f"{jax.device_count()} x {jax.devices()[0].device_kind}")

    def memory_report(self, compiled, state, mesh, layer, muon: dict):
        """Prints the memory report and writes memory_report.txt (memory.py; see
        memory.memory_annotations for `layer`, memory.memory_estimate for `muon`)."""
        if not self.writes:
            return
        title = self.mesh_title()
        text, _, _ = memory.memory_report(compiled, state, self.cfg.model.layers,
                                          *memory.memory_annotations(self.cfg, mesh, state, layer), muon, title)
        self.print(text.rstrip())
        self.write("memory_report.txt", text)

    def communication_report(self, compiled):
        """Prints the communication report and writes communication_report.txt: what the compiled
        step's collectives send (communication.py)."""
        if not self.writes:
            return
        title = self.mesh_title()
        try:
            collectives = communication.step_collectives(compiled.as_text())
        except ValueError as e:  # a report must not stop a run, e.g. if a new XLA prints HLO differently
            warn(f"no communication report: {e}")
            return
        text = communication.report(title, collectives)
        self.print(text.rstrip())
        self.write("communication_report.txt", text)

    # --- the loop

    def before_step(self, step: int, state):
        """Call before dispatching `step`: starts the profiler trace before the first profiled
        step, once the step before it has finished."""
        if self.profiled and step == self.profiled[0]:
            jax.block_until_ready(state)
            jax.profiler.start_trace(os.path.join(self.run_dir, "profile"), create_perfetto_trace=True)
            self.tracing = True
        self.dispatched[step] = time.perf_counter()

    def after_step(self, step: int, metrics):
        """Call after dispatching `step`: writes the line of the step before, holds this one
        back, and stops the trace once the last profiled step is done."""
        self.flush()
        self.held_back = (step, metrics)
        if self.profiled and step == self.profiled[-1]:
            jax.block_until_ready(metrics)
            self.finished[step] = time.perf_counter()
            jax.profiler.stop_trace()
            self.tracing = False
            self.print(f"profile of steps {self.profiled[0]}-{step} written to {os.path.join(self.run_dir, 'profile')} "
                       "(perfetto_trace.json.gz opens in https://ui.perfetto.dev)")
            self.profiled = range(0)

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

    def eval(self, step: int, evaluate):
        """Runs `evaluate() -> {"eval_loss": ..., "TASK/acc": ..., "TASK/acc_norm": ...}` (evaluation.py)
        on the weights after `step` steps (those of checkpoint `step`) and writes the line {"step": step,
        ..., "eval_time": seconds} to metrics.jsonl, TensorBoard and stdout, which also gives the time in
        training steps. The step before is logged first, so that its time does not include this."""
        self.flush()
        started = time.perf_counter()
        metrics = {**evaluate(), "eval_time": 0.0}
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
        if self.tracing:  # the run stopped inside the profiled steps
            jax.profiler.stop_trace()
        if not self.writes:
            return
        if self.dot_process is not None:
            try:  # a picture must not hold up the end of a run (or a preemption's exit)
                _, error = self.dot_process.communicate(timeout=DOT_WAIT_SECONDS)
                if self.dot_process.returncode:
                    warn(f"graphviz's dot failed on training_step.dot: {error.decode(errors='replace').strip()[:500]}")
            except subprocess.TimeoutExpired:
                self.dot_process.kill()
                self.dot_process.communicate()
                warn(f"graphviz's dot did not finish training_step.svg within {DOT_WAIT_SECONDS} s of the run's end "
                     "and was stopped; render it with "
                     f"`dot -Tsvg {os.path.join(self.run_dir, 'training_step.dot')} -o training_step.svg`")
        self.tensorboard.close()
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.close()
