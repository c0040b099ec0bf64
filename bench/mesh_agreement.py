"""The same training steps on several meshes, each step's loss relative to the first mesh's: how
much a mesh moves the numerics (the bounds of test_optimizer's and test_moe's mesh tests, and the
measurements in docs/moe.md, come from runs like these).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.mesh_agreement \\
        [--config local_test_synthetic] [--meshes 1x1x1 8x1x1 4x2x1 2x4x1] [--steps 3] [--seeds 0 1] \\
        [-- key=value ...]

Each mesh is DxTxC (mesh.d, mesh.t, mesh.c) on the first D*T*C devices of this process
(bench.memory.config_mesh). Every mesh starts from the same initial state (training.seed) and trains
on the same batches (dataset.seed: the loader's batches do not depend on the mesh); --seeds sets
both, one run of every mesh per seed.
Per seed it prints the first mesh's losses, then per mesh |loss / first mesh's loss - 1| at each step
and each step's expert load (the busiest expert's rows over the mean; 0 for a dense model), then the
largest gap of each step over the meshes. The runs are in this process, one mesh after the other.
"""

import argparse
import dataclasses
import sys

import jax

import train
from bench.memory import config_mesh
from seqax.config import Config, MeshConfig, SeqaxError, load_config
from seqax.data_loader import make_loader
from seqax.flat_tokens import open_flat_tokens
from seqax.validation import validate_config

DEFAULT_MESHES = ["1x1x1", "8x1x1", "4x2x1", "2x4x1"]


def parse_mesh(text: str) -> tuple[int, int, int]:
    """(d, t, c) from "DxTxC"."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not DxTxC with positive integers, e.g. 4x2x1")
    d, t, c = map(int, parts)
    return d, t, c


def metrics_on_meshes(cfg: Config, meshes: list[tuple[int, int, int]], steps: int) -> dict:
    """{(d, t, c): [the Metrics of each step, as floats]}: `steps` training steps from init_state on
    each mesh (the first d*t*c devices), on the loader's batches of cfg.dataset (the same on every mesh)."""
    dataset, runs = open_flat_tokens(cfg.dataset.path), {}
    for d, t, c in meshes:
        mesh = config_mesh(dataclasses.replace(cfg, mesh=MeshConfig(d, t, c)))
        loader = make_loader(cfg.dataset, dataset, "train", cfg.training.tokens.batch, cfg.training.tokens.len, mesh)
        with jax.set_mesh(mesh):
            state, runs[d, t, c] = train.init_state(cfg, mesh), []
            for step in range(steps):
                batch = loader.batch(step)
                state, metrics = train.training_step(state, jax.numpy.uint32(step), batch.targets, batch.is_seq_start,
                                                     batch.loss_mask, cfg)
                runs[d, t, c].append({k: float(v) for k, v in vars(metrics).items()})
        loader.close()
    return runs


def gaps(runs: dict) -> dict:
    """{mesh: [|loss / the first mesh's loss - 1| of each step]}."""
    reference = next(iter(runs.values()))
    return {mesh: [abs(m["loss"] / r["loss"] - 1) for m, r in zip(run, reference)] for mesh, run in runs.items()}


def table(seed: int, runs: dict) -> str:
    """The lines printed for one seed's runs: a row per mesh, then the largest gap of each step."""
    by_mesh, (reference, reference_run) = gaps(runs), next(iter(runs.items()))
    steps, name = len(reference_run), "x".join(map(str, reference))
    lines = [f"seed {seed}: {name}'s losses " + " ".join(f"{m['loss']:.6f}" for m in reference_run),
             f"  |loss / {name}'s - 1| at steps 0-{steps - 1} | expert load"]
    for mesh, run in runs.items():
        lines.append(f"  {'x'.join(map(str, mesh)):>7}  " + " ".join(f"{g:.1e}" for g in by_mesh[mesh])
                     + "  | " + " ".join(f"{m['expert_load']:.3f}" for m in run))
    largest = [max(g[step] for g in by_mesh.values()) for step in range(steps)]
    lines.append("  largest  " + " ".join(f"{g:.1e}" for g in largest))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.mesh_agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="local_test_synthetic")
    parser.add_argument("--meshes", nargs="+", type=parse_mesh, default=list(map(parse_mesh, DEFAULT_MESHES)),
                        help=f"DxTxC each; the first is the reference (default: {' '.join(DEFAULT_MESHES)})")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training.seed and dataset.seed")
    parser.add_argument("overrides", nargs="*", help="hydra overrides of the config, after --")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    try:
        for seed in args.seeds:
            cfg = load_config(args.config, ["+paths.model_name=mesh_agreement", *args.overrides,
                                            f"training.seed={seed}", f"dataset.seed={seed}"])
            max_token_id = open_flat_tokens(cfg.dataset.path).max_token_id
            for d, t, c in args.meshes:  # every mesh checked before any runs
                on_mesh = dataclasses.replace(cfg, mesh=MeshConfig(d, t, c))
                config_mesh(on_mesh)
                validate_config(on_mesh, d * t * c, max_token_id, train.Model)
            print(table(seed, metrics_on_meshes(cfg, args.meshes, args.steps)), flush=True)
    except SeqaxError as e:
        sys.exit(f"bench.mesh_agreement: error: {e}")


if __name__ == "__main__":
    main()
