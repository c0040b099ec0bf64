"""Parameters and memory per device of configs, without running them: the training step is
compiled ahead of time for abstract inputs (jax.ShapeDtypeStruct: nothing is allocated), on a
mesh of the config's shape made from this machine's devices. That is how the ladder configs
(configs/gpu1_*, gpu8_*, tpu8_*) were sized on a CPU machine:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.memory \\
        --config gpu1_125m gpu8_2b tpu8_1b [--report] [-- key=value ...]

Per config: the parameters; the model's FLOPs per step (train.model_flops_per_token) and Muon's
Newton-Schulz FLOPs (train.newton_schulz_flops), in all and as a share of the step's time at equal
MFU (the busiest device's Newton-Schulz over a device's share of the model's FLOPs); and two
memory figures per device, both in GiB:
- estimate: memory.memory_estimate, from the code's annotations (weights, optimizer state,
  gradients, one layer's gathered weights, every save_for_backward, the logits, Muon's buffers), without the
  f32 copies that only XLA:CPU makes: what a GPU or TPU holds, give or take XLA's temporaries.
- XLA:CPU peak: memory_analysis() of the step compiled here. XLA:CPU has no bf16 arithmetic and
  fuses differently from XLA:GPU/TPU, so this is a second opinion, usually the larger.
--report prints the whole memory report (memory.memory_report) of each config, and
--communication its communication report (communication.py: the compiled step's collectives,
loops counted, next to the formula, and their time at NVLink, InfiniBand and ICI bandwidths).
"""

import argparse
import math
from functools import partial

import jax

import train
from seqax import config
from seqax.analysis import communication, memory
from seqax.analysis.startup_report import compile_step
from seqax.shardlib.shardtypes import abstract_arrays
from seqax.validation import validate_config

GiB = 2**30


def abstract_state(cfg: config.Config, mesh) -> train.State:
    """The training state as ShapeDtypeStructs with their shardings on `mesh`."""
    return abstract_arrays(jax.eval_shape(lambda: train.init_state(cfg, mesh)), train.State, mesh)


def parameter_count(state: train.State) -> int:
    return sum(math.prod(w.shape) for w in jax.tree.leaves(state.weights))


def config_mesh(cfg: config.Config):
    """The config's (d, t, c) mesh on the first d*t*c devices of this machine."""
    needed = cfg.mesh.d * cfg.mesh.t * cfg.mesh.c
    if needed > jax.device_count():
        raise SystemExit(f"mesh d={cfg.mesh.d} t={cfg.mesh.t} c={cfg.mesh.c} needs {needed} devices, "
                         f"this machine has {jax.device_count()}; "
                         f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={needed}")
    return train.make_mesh(cfg.mesh.d, cfg.mesh.t, cfg.mesh.c, devices=jax.devices()[:needed])


def accelerator_estimate(cfg: config.Config, mesh) -> tuple[list[tuple[str, int]], train.State, memory.LayerMemory]:
    """memory.py's estimate per device of a GPU or TPU (its terms), from shapes alone (no
    compilation), with the abstract state and the account of one layer it came from."""
    with jax.set_mesh(mesh):
        state = abstract_state(cfg, mesh)
        layer = memory.memory_annotations(cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward)
    terms, _ = memory.memory_estimate(state, layer, train.MUON)
    return terms, state, layer


def measure(name: str, overrides: list[str], report: bool, communication_report: bool = False) -> dict:
    cfg = config.load_config(name, overrides + ["+paths.model_name=memory"])
    validate_config(cfg, cfg.mesh.d * cfg.mesh.t * cfg.mesh.c, max_token_id=0, weights=train.Model)
    mesh = config_mesh(cfg)
    terms, state, layer = accelerator_estimate(cfg, mesh)
    with jax.set_mesh(mesh):
        compiled = compile_step(train.training_step, cfg, state, mesh)
    if report:
        title = (f"{name}, mesh d={cfg.mesh.d} t={cfg.mesh.t} c={cfg.mesh.c}, "
                 f"compiled for {jax.devices()[0].device_kind}")
        print(memory.memory_report(compiled, state, layer, train.MUON, title)[0])
    if communication_report:
        collectives = communication.step_collectives(compiled.as_text())
        print(communication.report(f"{name}, mesh d={cfg.mesh.d} t={cfg.mesh.t} c={cfg.mesh.c}", collectives))
    devices = cfg.mesh.d * cfg.mesh.t * cfg.mesh.c
    model_flops = train.model_flops_per_token(cfg.model, cfg.training.tokens.len) * cfg.training.tokens.batch \
        * cfg.training.tokens.len
    newton_schulz, busiest = train.newton_schulz_flops(cfg.model, devices)
    return {
        "config": name,
        "model_tflop": model_flops / 1e12,
        "newton_schulz_tflop": newton_schulz / 1e12,
        # Muon's time against the model's at the same MFU: the busiest device's Newton-Schulz over a device's share
        "newton_schulz_share": busiest / (model_flops / devices),
        "parameters": parameter_count(state),
        "mesh": f"d={cfg.mesh.d} t={cfg.mesh.t} c={cfg.mesh.c}",
        "batch": f"{cfg.training.tokens.batch} x {cfg.training.tokens.len}",
        "estimate_gib": sum(size for _, size in terms) / GiB,
        "xla_cpu_peak_gib": memory.compiled_peak_bytes(compiled.memory_analysis()) / GiB,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", required=True, help="config names (configs/NAME.yaml)")
    parser.add_argument("--report", action="store_true", help="print each config's whole memory report")
    parser.add_argument("--communication", action="store_true", help="print each config's communication report")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every config, after --")
    args = parser.parse_args(argv)
    print(f"{'config':<14} {'parameters':>15} {'mesh':>9} {'batch':>11} {'estimate':>12} {'XLA:CPU peak':>13}"
          f"  (per device)  {'model TFLOP':>11} {'Newton-Schulz TFLOP':>19} {'its time share':>14}")
    for name in args.config:
        row = measure(name, args.overrides, args.report, args.communication)
        sizes = f"{row['estimate_gib']:>8.1f} GiB {row['xla_cpu_peak_gib']:>9.1f} GiB"
        flops = f"{row['model_tflop']:>11.1f} {row['newton_schulz_tflop']:>19.2f} {row['newton_schulz_share']:>14.1%}"
        print(f"{row['config']:<14} {row['parameters']:>15,} {row['mesh']:>9} {row['batch']:>11} {sizes}"
              f"{'':14}  {flops}", flush=True)


if __name__ == "__main__":
    main()
