"""The training step compiled for GPUs and TPUs that are not here, by their own compilers: memory per
device, collectives and the roofline's step time, MFU ceiling and where the time goes.

    make compilers    # once: .venv-compilers, with JAX's CUDA plugin and libtpu (requirements-compilers.txt)
    .venv-compilers/bin/python -m bench.compile_for --config gpu8_1b [gpu1_1b ...] --target h200 [v6e ...] \\
        [--json rows.json] [--top 10] [-- key=value ...]

Each config is compiled for each target on as many devices as its mesh has (GPUs: hosts of 8; TPU
chips: the smallest slice), with the real step (startup_report.compile_step) on abstract state: no
device, no dataset. Targets: seqax/analysis/targets.py (h100, h200, b200, v5e, v5p, v6e). For each it prints
the compile time; memory per device as the target's compiler plans it (memory_analysis), against
the device's memory and memory.py's estimate; the collectives (the bytes one device sends, by kind, as
the roofline prices them), and how many the compiler made asynchronous; and the roofline (roofline.py,
docs/roofline.md): step time, tokens/s, MFU ceiling, the time by kind, and the costliest lines of train.py
(the kernels of each line and JAX operation summed over the layers, forward and backward).
"""

import os

# Compile for the targets and run nothing: no device is needed, and none is looked for. The CUDA
# plugin compiles without a driver; libtpu, without these, looks for the hosts of a TPU pod, and
# refuses to load while another process holds it (its lock file), which a compile without a TPU
# need not (several compiles run at once: the test workers).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-8")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The TPU compiler's flags a run sets (train.main), so that the program compiled here is the run's.
from seqax.xla_tpu import add_tpu_flags  # noqa: E402

add_tpu_flags()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import train  # noqa: E402
from seqax.analysis import memory, roofline  # noqa: E402
from seqax.analysis.startup_report import compile_step  # noqa: E402
from seqax.analysis.targets import TARGETS, Target  # noqa: E402
from seqax.config import SeqaxError, load_config  # noqa: E402
from seqax.console import first_line  # noqa: E402
from seqax.multihost import make_mesh  # noqa: E402
from seqax.shardlib.shardtypes import abstract_arrays  # noqa: E402
from seqax.validation import validate_config  # noqa: E402

GiB = 2**30
# Where the time goes, by the code a kernel came from (its innermost frame in train.py; JAX records
# none inside a custom VJP's rules, so attention's kernels stop at the layer's `attend`).
OPTIMIZER = ("newton_schulz", "muon_update", "adamw_update", "optimizer_step", "schedule")
KINDS = ("matmuls", "attention", "elementwise, norms, converts", "experts: matmuls",
         "experts: dispatch (routing, gathers, combine)", "optimizer: Newton-Schulz", "optimizer: other",
         "communication (exposed)", "transfers (exposed)")
# What an elementwise kernel is made of (the op its code named): inside experts_block these are the
# experts' SwiGLU and roundings, as the dense SwiGLU's, and float8's amax of each block (reduce_max: the
# dispatch takes no maximum); the rest there moves rows (the dispatch).
ELEMENTWISE = ("convert_element_type", "mul", "add", "sub", "logistic", "exp", "div", "neg", "max", "min",
               "reduce_max")
# The compilers, by platform: the modules that may hold each (any one will do) and its packages
# (requirements-compilers.txt pins CUDA 12's; jax 0.11 on the lent GPU machine has CUDA 13's).
COMPILERS = {"cuda": (("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"), "jax-cuda12-plugin and jax-cuda12-pjrt"),
             "tpu": (("libtpu",), "libtpu")}


class CompilerError(SeqaxError):
    """A target's compiler is missing or failed."""


def synchronous_by_op(collectives: list[roofline.Kernel]) -> dict[str, float]:
    """Runs a step of the collectives the compiler does not overlap, by HLO opcode (all-gather, all-to-all, ...)."""
    runs: dict[str, float] = {}
    for c in collectives:
        if not c.asynchronous:
            runs[c.opcode] = runs.get(c.opcode, 0) + c.runs
    return runs


def sent_by_kind(collectives: list[roofline.Kernel]) -> dict[str, float]:
    """MiB a device sends a step, by kind of collective (all-gather, reduce-scatter, all-reduce, ...): each
    collective's HLO opcode, an asynchronous one's without its "-start"."""
    sent: dict[str, float] = {}
    for c in collectives:
        kind = c.opcode.removesuffix("-start")
        sent[kind] = sent.get(kind, 0.0) + c.bytes * c.runs / 2**20
    return sent


def category(kernel: roofline.Kernel) -> str:
    if kernel.kind == "collective":
        return "communication (exposed)"
    if not kernel.computes:
        return "transfers (exposed)"
    functions = [function for file, function, _ in kernel.stack if file.endswith(("train.py", "attention.py"))]
    files = [file for file, _, _ in kernel.stack]
    if any(f.endswith("attend") for f in functions) or any(f.endswith("attention.py") for f in files):
        return "attention"
    if any(f.split(".")[0] == "newton_schulz" for f in functions):
        return "optimizer: Newton-Schulz"
    if any(f.split(".")[0] in OPTIMIZER for f in functions):
        return "optimizer: other"
    experts = any(f.split(".")[0] == "experts_block" for f in functions)
    if experts and kernel.kind == "matmul":
        return "experts: matmuls"
    if experts and kernel.op_name.rsplit("/", 1)[-1] not in ELEMENTWISE:
        return "experts: dispatch (routing, gathers, combine)"  # the experts' SwiGLU stays elementwise
    return "matmuls" if kernel.kind == "matmul" else "elementwise, norms, converts"


def where(kernel: roofline.Kernel) -> str:
    """The innermost frame of the kernel's stack in train.py, as train.py:function:line."""
    frame = roofline.source(kernel, ("train.py",))
    return f"train.py:{frame[1]}:{frame[2]}" if frame else "?"


def target_devices(target: Target, devices: int):
    """The devices of `devices` `target`s (a topology: JAX makes them without hardware)."""
    modules, package = COMPILERS[target.platform]
    if not any(importlib.util.find_spec(m.split(".")[0]) and importlib.util.find_spec(m) for m in modules):
        raise CompilerError(f"the {target.platform.upper()} compiler ({package}) is not installed in this venv; "
                            "run `make compilers` and use .venv-compilers/bin/python")
    name, options = target.topology(devices)
    try:
        if target.platform == "cuda":
            topology = topologies.get_topology_desc(target.name, "cuda", target_config=target.gpu_target_config(),
                                                    topology=name)
        else:
            topology = topologies.get_topology_desc(name, "tpu", **options)
    except Exception as e:  # the plugin's own errors
        first = first_line(e)
        raise CompilerError(f"the {package} compiler could not describe {devices} x {target.name} ({name}): "
                            f"{first}") from None
    return topology.devices


def compile_for(config: str, target: Target, overrides: list[str], top: int) -> dict:
    cfg = load_config(config, overrides + ["+paths.model_name=compile_for"])
    devices = cfg.mesh.d * cfg.mesh.t * cfg.mesh.c
    validate_config(cfg, devices, max_token_id=cfg.model.vocab - 1, weights=train.Model)
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t, cfg.mesh.c, devices=target_devices(target, devices))
    # A large step compiles for minutes on a small CPU: say what is compiling before it starts.
    print(f"compiling {config}'s training step for {devices} x {target.name} ({target.topology(devices)[0]}), "
          f"mesh d={cfg.mesh.d} t={cfg.mesh.t} c={cfg.mesh.c}...", flush=True)
    with jax.set_mesh(mesh):
        state = abstract_arrays(jax.eval_shape(lambda: train.init_state(cfg, mesh)), train.State, mesh)
        started = time.perf_counter()
        try:
            compiled = compile_step(train.training_step, cfg, state, mesh)
        except Exception as e:  # the target compiler's failure (out of memory, unsupported op, ...)
            first = first_line(e)
            raise CompilerError(f"{target.name}'s compiler failed on {config}: {first[:500]}") from None
        compile_seconds = time.perf_counter() - started
        layer = memory.memory_annotations(cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward)
        estimate = sum(size for _, size in memory.memory_estimate(state, layer, train.MUON)[0])
    hlo_text = compiled.as_text()
    planned = memory.compiled_peak_bytes(compiled.memory_analysis())
    model = roofline.roofline(hlo_text, target.rates())
    collectives = [k for k in model.kernels if k.kind == "collective"]
    tokens = cfg.training.tokens.batch * cfg.training.tokens.len
    model_flops = train.model_flops_per_token(cfg.model, cfg.training.tokens.len) * tokens / devices
    seconds = model.seconds_by(category)
    return {
        "config": config, "target": target.name, "devices": devices, "topology": target.topology(devices)[0],
        "mesh": f"d={cfg.mesh.d} t={cfg.mesh.t} c={cfg.mesh.c}", "tokens_per_step": tokens,
        "compile_seconds": compile_seconds,
        "memory_gib": planned / GiB, "device_memory_gib": target.memory_bytes / GiB,
        "memory_fraction": planned / target.memory_bytes, "estimate_gib": estimate / GiB,
        "collectives_per_step": sum(c.runs for c in collectives),
        "asynchronous_collectives": sum(c.runs for c in collectives if c.asynchronous),
        "synchronous_collectives_by_op": synchronous_by_op(collectives),
        "communication_mib_by_kind": sent_by_kind(collectives),
        "communication_mib": sum(c.bytes * c.runs for c in collectives) / 2**20,
        "communication_seconds": model.synchronous_seconds + model.asynchronous_seconds,
        "step_seconds": model.step_seconds, "tokens_per_second": tokens / model.step_seconds,
        "mfu_ceiling": model_flops / (model.step_seconds * target.peak_flops),
        "model_tflop_per_device": model_flops / 1e12, "hlo_matmul_tflop_per_device": model.matmul_flops / 1e12,
        "hlo_recomputed_matmul_tflop_per_device": model.recomputed_matmul_flops / 1e12,
        "hlo_float8_matmul_tflop_per_device": model.float8_matmul_flops / 1e12,
        "kernels_per_step": model.launches,
        "seconds_by_kind": {kind: seconds.get(kind, 0.0) for kind in KINDS},
        "costliest": costliest_lines(model.kernels, model.step_seconds)[:top],
    }


def costliest_lines(kernels: list[roofline.Kernel], step_seconds: float) -> list[dict]:
    """The kernels that compute, summed by where they came from (train.py's line and the JAX operation, with their
    kind), costliest first: the layers' copies of one line (an unrolled loop's, a kernel a layer) and its forward
    and backward kernels are one row, whose runs are theirs all together (its name: its first kernel's)."""
    lines: dict[tuple, dict] = {}
    for k in kernels:
        if not k.computes:
            continue
        key = (category(k), where(k), k.op_name.rsplit("/", 1)[-1])
        line = lines.setdefault(key, {"name": k.name, "kind": key[0], "where": key[1], "op": key[2], "kernels": 0,
                                      "runs": 0.0, "seconds": 0.0, "tflop": 0.0, "gb": 0.0})
        line["kernels"] += 1
        line["runs"] += k.runs
        line["seconds"] += k.total_seconds
        line["tflop"] += k.flops * k.runs / 1e12
        line["gb"] += k.bytes * k.runs / 1e9
    for line in lines.values():
        line["share"] = line["seconds"] / step_seconds
    return sorted(lines.values(), key=lambda line: -line["seconds"])


def report(row: dict) -> str:
    lines = [f"{row['config']} on {row['devices']} x {row['target']} ({row['topology']}), mesh {row['mesh']}: "
             f"compiled in {row['compile_seconds']:.1f} s",
             f"  memory per device (the target compiler's plan): {row['memory_gib']:.1f} GiB of "
             f"{row['device_memory_gib']:.1f} ({row['memory_fraction']:.0%}); memory.py's estimate "
             f"{row['estimate_gib']:.1f} GiB",
             f"  collectives: {row['collectives_per_step']:.0f} a step ({row['asynchronous_collectives']:.0f} "
             f"asynchronous), {row['communication_mib']:.0f} MiB sent per device, "
             f"{row['communication_seconds'] * 1e3:.1f} ms at the links' bandwidth",
             f"  roofline: step {row['step_seconds'] * 1e3:.1f} ms, {row['tokens_per_second']:,.0f} tokens/s, "
             f"MFU ceiling {row['mfu_ceiling']:.1%} ({row['model_tflop_per_device']:.1f} model TFLOP per device; "
             f"the HLO's matmuls {row['hlo_matmul_tflop_per_device']:.1f}, in float8 "
             f"{row['hlo_float8_matmul_tflop_per_device']:.1f}, recomputed for backward "
             f"{row['hlo_recomputed_matmul_tflop_per_device']:.1f}); {row['kernels_per_step']:,.0f} kernels",
             "  where the time goes:"]
    lines += [f"    {kind:<30} {seconds * 1e3:9.1f} ms {seconds / row['step_seconds']:6.1%}"
              for kind, seconds in row["seconds_by_kind"].items()]
    lines.append("  costliest lines of train.py (their kernels summed over the layers, forward and backward):")
    lines += [f"    {k['seconds'] * 1e3:8.2f} ms {k['share']:6.1%}  x{k['runs']:<6.0f} {k['kind']:<30} "
              f"{k['tflop']:7.2f} TFLOP {k['gb']:8.1f} GB  {k['where']} ({k['op']})" for k in row["costliest"]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", required=True, help="config names (configs/NAME.yaml)")
    parser.add_argument("--target", nargs="+", required=True, choices=sorted(TARGETS), help="devices to compile for")
    parser.add_argument("--json", help="also write the rows there, as a JSON list")
    parser.add_argument("--top", type=int, default=10,
                        help="how many of the costliest lines of train.py to list (kernels summed by line and op)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every config, after --")
    args = parser.parse_args(argv)
    rows = []
    try:
        for config in args.config:
            for name in args.target:
                rows.append(compile_for(config, TARGETS[name], args.overrides, args.top))
                print(report(rows[-1]) + "\n", flush=True)
    except SeqaxError as e:
        sys.exit(f"bench.compile_for: error: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

