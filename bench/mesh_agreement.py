"""The same training steps on several meshes, each step's loss relative to the first mesh's: how
much a mesh moves the numerics (the bounds of test_optimizer's and test_moe's mesh tests, and the
measurements in docs/moe.md, come from runs like these).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.mesh_agreement \\
        [--config local_test_synthetic] [--meshes 1x1x1 8x1x1 4x2x1 2x4x1] [--steps 3] [--seeds 0 1] \\
        [--rows-reversed] [-- key=value ...]

Each mesh is DxTxC (mesh.d, mesh.t, mesh.c) on the first D*T*C devices of this process
(bench.memory.config_mesh). Every mesh starts from the same initial state (training.seed) and trains
on the same batches (dataset.seed: the loader's batches do not depend on the mesh); --seeds sets
both, one run of every mesh per seed.
Per seed it prints the first mesh's losses, then per mesh |loss / first mesh's loss - 1| at each step
and each step's expert load (the busiest expert's rows over the mean; 0 for a dense model), then the
largest gap of each step over the meshes. The runs are in this process, one mesh after the other.

--rows-reversed adds a control: the first mesh again, each batch's rows in reverse order. The math is
the same and only the order of the sums over rows differs, so its gap is what rounding alone moves the
losses by, with no other mesh involved: the scale to read the meshes' gaps against.
"""

import argparse
import dataclasses
import sys

import jax
import numpy as np

import train
from bench.memory import config_mesh
from seqax.config import Config, MeshConfig, SeqaxError, load_config
from seqax.data.data_loader import make_loader
from seqax.data.flat_tokens import open_flat_tokens
from seqax.validation import validate_config

DEFAULT_MESHES = ["1x1x1", "8x1x1", "4x2x1", "2x4x1"]


def parse_mesh(text: str) -> tuple[int, int, int]:
    """(d, t, c) from "DxTxC"."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not DxTxC with positive integers, e.g. 4x2x1")
    d, t, c = map(int, parts)
    return d, t, c


def metrics_on_meshes(cfg: Config, meshes: list[tuple[int, int, int]], steps: int, rows_reversed: bool = False) -> dict:
    """{(d, t, c): [the Metrics of each step, as floats]}: `steps` training steps from init_state on
    each mesh (the first d*t*c devices), on the loader's batches of cfg.dataset (the same on every mesh);
    with `rows_reversed`, each batch's rows in reverse order (the same loss, summed in another order)."""
    dataset, runs = open_flat_tokens(cfg.dataset.path), {}
    for d, t, c in meshes:
        mesh = config_mesh(dataclasses.replace(cfg, mesh=MeshConfig(d, t, c)))
        loader = make_loader(cfg.dataset, dataset, "train", cfg.training.tokens.batch, cfg.training.tokens.len, mesh)
        with jax.set_mesh(mesh):
            state, runs[d, t, c] = train.init_state(cfg, mesh), []
            for step in range(steps):
                batch = loader.batch(step)
                arrays = (batch.targets, batch.is_seq_start, batch.loss_mask)
                if rows_reversed:  # (this process holds every device: the whole array is here)
                    arrays = tuple(jax.device_put(np.asarray(x)[::-1].copy(), x.sharding) for x in arrays)
                state, metrics = train.training_step(state, jax.numpy.uint32(step), *arrays, cfg)
                runs[d, t, c].append({k: float(v) for k, v in vars(metrics).items()})
        loader.close()
    return runs


def gaps(runs: dict) -> dict:
    """{mesh: [|loss / the first mesh's loss - 1| of each step]}."""
    reference = next(iter(runs.values()))
    return {mesh: [abs(m["loss"] / r["loss"] - 1) for m, r in zip(run, reference)] for mesh, run in runs.items()}


def table(seed: int, runs: dict, reversed_run: list | None = None) -> str:
    """The lines printed for one seed's runs: a row per mesh, then the largest gap of each step, then
    (if given) the row of `reversed_run`, the first mesh's steps on the batches' rows reversed."""
    by_mesh, (reference, reference_run) = gaps(runs), next(iter(runs.items()))
    steps, name = len(reference_run), "x".join(map(str, reference))
    lines = [f"seed {seed}: {name}'s losses " + " ".join(f"{m['loss']:.6f}" for m in reference_run),
             f"  |loss / {name}'s - 1| at steps 0-{steps - 1} | expert load"]
    for mesh, run in runs.items():
        lines.append(f"  {'x'.join(map(str, mesh)):>7}  " + " ".join(f"{g:.1e}" for g in by_mesh[mesh])
                     + "  | " + " ".join(f"{m['expert_load']:.3f}" for m in run))
    largest = [max(g[step] for g in by_mesh.values()) for step in range(steps)]
    lines.append("  largest  " + " ".join(f"{g:.1e}" for g in largest))
    if reversed_run is not None:
        control = gaps({reference: reference_run, "reversed": reversed_run})["reversed"]
        lines.append(f"  {name}, rows reversed  " + " ".join(f"{g:.1e}" for g in control)
                     + "  | " + " ".join(f"{m['expert_load']:.3f}" for m in reversed_run))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.mesh_agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="local_test_synthetic")
    parser.add_argument("--meshes", nargs="+", type=parse_mesh, default=list(map(parse_mesh, DEFAULT_MESHES)),
                        help=f"DxTxC each; the first is the reference (default: {' '.join(DEFAULT_MESHES)})")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training.seed and dataset.seed")
    parser.add_argument("--rows-reversed", action="store_true",
                        help="also run the first mesh with each batch's rows reversed: the gap of rounding alone")
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
            runs = metrics_on_meshes(cfg, args.meshes, args.steps)
            first = args.meshes[0]
            reversed_run = (metrics_on_meshes(cfg, [first], args.steps, rows_reversed=True)[first]
                            if args.rows_reversed else None)
            print(table(seed, runs, reversed_run), flush=True)
    except SeqaxError as e:
        sys.exit(f"bench.mesh_agreement: error: {e}")


if __name__ == "__main__":
    main()
