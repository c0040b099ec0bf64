"""What a run reports at start-up, once its training step is compiled and before it runs: the compile
time; the model's FLOPs against XLA's count; the optimized HLO (training_step.hlo.txt) and its
graph (training_step.dot and .svg, drawn by graphviz in the background); the memory report
(memory_report.txt, memory.py); the communication report (communication_report.txt,
communication.py); on a GPU or TPU that seqax/analysis/targets.py knows, the roofline of the compiled step
(roofline.py). The reports go to files; the console gets a line of each, so that everything before
the first step fits a screen. Only process 0 prints and writes. A report that cannot be written (a
full disk, no permission) stops the run before its first step with one line naming the file; the
graph is optional: it warns instead.
"""

import os
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp

from seqax.analysis import communication, hlo_graph, memory, roofline
from seqax.analysis.targets import target_for
from seqax.config import OutputError
from seqax.console import first_line, warn

DOT_WAIT_SECONDS = 30  # how long the end of a run waits for graphviz, which started at compile time


def compile_step(training_step, cfg, state, mesh):
    """`training_step(state, step, targets, is_seq_start, loss_mask, cfg)` (train.py's) compiled
    ahead of time for this state (arrays or ShapeDtypeStructs) and batches of the config's shape
    split over d and c, as the loader makes them, so that a run reports its compile time, FLOPs
    and memory before the first step; the loop runs it. Every argument is abstract, so the mesh may
    be of devices that are not here (bench/compile_for.py compiles for GPUs and TPUs this way)."""
    shape = (cfg.training.tokens.batch, cfg.training.tokens.len)
    sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("d", "c"))
    batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for dtype in (jnp.uint32, jnp.bool_, jnp.bool_)]
    step = jax.ShapeDtypeStruct((), jnp.uint32, sharding=jax.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return training_step.lower(state, step, *batch, cfg).compile()


def flops_check(compiled, cfg, flops_per_token, optimizer_flops) -> str:
    """The model's FLOPs per step (`flops_per_token(model config, seq_len)` times the tokens), the
    optimizer's (`optimizer_flops(model config, devices)`: in all and on the busiest device) and
    XLA's count for the compiled step of the run's config `cfg`, as a line of text.

    XLA's cost_analysis() counts the body of a while loop once, not once per iteration (on jax
    0.10.2), so the step's count is comparable only because the layers run as a Python loop, each
    its own code: what it has is the model's FLOPs plus the optimizer's on every device (each counts
    its own program, whose work is the busiest device's). XLA counts a little more than that: the
    full L x L score matmuls where MFU takes the causal half, QK^T recomputed in the backward pass,
    and elementwise work, 1 FLOP per element per operation; and less where attention's block loop
    runs more than once (docs/observability.md)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    devices = jax.device_count()
    xla = float(cost.get("flops", 0.0)) * devices if cost else 0.0
    seq_len, tokens_per_step = cfg.training.tokens.len, cfg.training.tokens.batch * cfg.training.tokens.len
    formula = flops_per_token(cfg.model, seq_len) * tokens_per_step
    optimizer, busiest = optimizer_flops(cfg.model, devices)
    line = (f"FLOPs per step: model {formula / 1e9:.4g} G, Newton-Schulz {optimizer / 1e9:.4g} G "
            f"({optimizer / formula:.1%}; {busiest / 1e9:.4g} G on the busiest of {devices} devices)")
    if not xla:
        return line + "; XLA gives no count on this backend"
    return line + f"; XLA counts {xla / (formula + busiest * devices):.3f} x theirs"


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def device_memory(device) -> tuple[int, int]:
    """(bytes, devices sharing them) of a device's memory: an accelerator's own, or the host's that
    its CPU devices share."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"], 1
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemTotal"].split()[0]) * 1024, len(jax.local_devices())


def memory_line(planned: float, estimate: float, device) -> str:
    """The memory report's line: XLA's plan per device (`planned`, nan where it has none) and the estimate
    from the code, against the device's memory."""
    if planned != planned:
        return f"memory per device: {size(estimate)} estimated from the code (XLA gives no plan): memory_report.txt"
    limit, sharing = device_memory(device)
    of = (f"of {size(limit)} ({planned / limit:.0%})" if sharing == 1 else
          f"x {sharing} devices of the host's {size(limit)} ({planned * sharing / limit:.1%})")
    return (f"memory per device: {size(planned)} as XLA plans it ({size(estimate)} estimated from the code) {of}: "
            "memory_report.txt")


class StartupReport:
    """The start-up reports of a run into `run_dir` (config.Config `cfg`), printed and written by
    process 0. close() waits for the graph's drawing, which runs in the background."""

    def __init__(self, run_dir: str, cfg):
        self.run_dir, self.cfg = run_dir, cfg
        self.writes = jax.process_index() == 0
        self.dot_process = None

    def print(self, text: str):
        if self.writes:
            print(text, flush=True)

    def write(self, name: str, text: str):
        path = os.path.join(self.run_dir, name)
        if self.writes:
            try:
                with open(path, "w") as f:
                    f.write(text)
            except OSError as e:
                raise OutputError(f"cannot write {path}: {e.strerror or e}; the run stops before its first step: "
                                  "free space (or fix the permission) and run the same command again") from None

    def compile(self, lower_and_compile, flops_per_token, optimizer_flops):
        """Runs `lower_and_compile()` (returns a jax Compiled), writes the optimized HLO with its graph,
        and prints the compile time, the FLOPs check (see flops_check for the two counts) and, where
        a roofline exists, its MFU ceiling."""
        started = time.perf_counter()
        compiled = lower_and_compile()
        seconds = time.perf_counter() - started
        written = self._write_hlo(compiled.as_text()) if self.writes else ""
        self.print(f"compiled the training step in {seconds:.1f} s: {os.path.join(self.run_dir, 'training_step')}"
                   f".hlo.txt{written}")
        self.print(flops_check(compiled, self.cfg, flops_per_token, optimizer_flops))
        self.print_roofline(compiled, flops_per_token)
        return compiled

    def _write_hlo(self, hlo_text: str) -> str:
        """Writes the HLO and its graph; returns what of the graph is written, as the files' suffixes."""
        path = lambda suffix: os.path.join(self.run_dir, f"training_step.{suffix}")  # noqa: E731
        self.write("training_step.hlo.txt", hlo_text)
        try:
            graph = hlo_graph.to_dot(hlo_text, "training_step")
        except Exception as e:  # a picture must not stop a run, e.g. if a new XLA prints HLO differently
            warn(f"could not draw the HLO graph of training_step.hlo.txt: {e!r}")
            return ""
        try:
            with open(path("dot"), "w") as f:
                f.write(graph)
        except OSError as e:
            warn(f"could not write {path('dot')}: {e.strerror or e}; there is no graph of the step (it is optional)")
            return ""
        if shutil.which("dot") is None:  # optional: said in the line, not warned about on every run
            return ", .dot (no .svg: graphviz is not installed)"
        # Rendered in the background at the lowest priority, so that it takes no CPU from the
        # steps (on a 2-core machine it held one core for 15-30 s of the first steps); close()
        # waits for it, when the steps no longer need the CPU.
        self.dot_process = subprocess.Popen(["dot", "-Tsvg", path("dot"), "-o", path("svg")],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            os.setpriority(os.PRIO_PROCESS, self.dot_process.pid, 19)
        except ProcessLookupError:  # it has already finished
            pass
        return ", .dot, .svg (drawn in the background)"

    def print_roofline(self, compiled, flops_per_token):
        """On a GPU or TPU that targets.py knows: the roofline's step time and MFU ceiling for the
        compiled step (roofline.py, docs/roofline.md), what its MFU reaches at best."""
        device = jax.devices()[0]
        target = target_for(device.device_kind) if device.platform != "cpu" else None
        if not self.writes or target is None:
            return
        try:
            seconds = roofline.roofline(compiled.as_text(), target.rates()).step_seconds
        except Exception as e:  # a model that cannot read this program must not stop a run
            warn(f"no roofline of the compiled step: {first_line(e)}")
            return
        tokens = self.cfg.training.tokens.batch * self.cfg.training.tokens.len
        model_flops = flops_per_token(self.cfg.model, self.cfg.training.tokens.len) * tokens / jax.device_count()
        self.print(f"roofline of the compiled step on {target.name}: {seconds * 1e3:.3g} ms a step, MFU ceiling "
                   f"{model_flops / (seconds * target.peak_flops):.1%} (docs/roofline.md)")

    def mesh_title(self) -> str:
        """The reports' title: the mesh and the devices."""
        return (f"mesh d={self.cfg.mesh.d} t={self.cfg.mesh.t} c={self.cfg.mesh.c}, "
                f"{jax.device_count()} x {jax.devices()[0].device_kind}")

    def memory_report(self, compiled, state, mesh, layer, forward, muon: dict):
        """Writes memory_report.txt and prints its line (memory.py; see
        memory.memory_annotations for `layer` and `forward`, memory.memory_estimate for `muon`)."""
        if not self.writes:
            return
        layer_memory = memory.memory_annotations(self.cfg, mesh, state, layer, forward)
        text, estimate, planned = memory.memory_report(compiled, state, layer_memory, muon, self.mesh_title())
        self.write("memory_report.txt", text)
        self.print(memory_line(planned, estimate, jax.local_devices()[0]))

    def communication_report(self, compiled):
        """Writes communication_report.txt, what the compiled step's collectives send (communication.py),
        and prints its line."""
        if not self.writes:
            return
        try:
            collectives = communication.step_collectives(compiled.as_text())
        except ValueError as e:  # a report must not stop a run, e.g. if a new XLA prints HLO differently
            warn(f"no communication report: {e}")
            return
        self.write("communication_report.txt", communication.report(self.mesh_title(), collectives))
        self.print(f"communication per device per step: {size(sum(communication.totals(collectives).values()))} in "
                   f"{sum(c.runs for c in collectives)} collectives: communication_report.txt")

    def close(self):
        """Waits (up to DOT_WAIT_SECONDS) for graphviz to finish training_step.svg."""
        if self.dot_process is None:
            return
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
