"""Reading a run directory: its config.yaml, a mesh for the devices at hand, a checkpoint's
weights. sample.py and tools/export_hf.py use it; it only reads (no lock, nothing written), so
it may run beside the training run that writes the directory. The model's weights are given by
the caller (train.py's init_weights and Model), so that this module stays below train.py.
"""

import dataclasses
import os

import jax
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from seqax.checkpoint import Checkpointer, CheckpointRemoved
from seqax.config import CheckpointConfig, ConfigError, ModelConfig, config_from_dict
from seqax.console import first_line
from seqax.multihost import make_mesh
from seqax.shardlib.shardtypes import make_shardings
from seqax.validation import mesh_misfit

NEWEST_ATTEMPTS = 5  # reads of the newest checkpoint that rotation may remove under a reader, before it gives up


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What sampling and export need of a run's config.yaml. Only these sections are read, so
    runs written before a training-only key was added still load."""

    model: ModelConfig
    checkpoints: CheckpointConfig
    dataset_path: str
    seq_len: int  # training.tokens.len
    trained_context_devices: int  # mesh.c of the training run; sampling and export run with c = 1 whatever it was


def load_run_config(run_dir: str) -> RunConfig:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise ConfigError(f"{path} does not exist; "
                          "--run-dir must be a run directory (paths.root_working_dir/paths.model_name)")
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException) as e:
        first = first_line(e)
        raise ConfigError(f"cannot read {path}: {first}; --run-dir must be a seqax run directory") from None
    try:
        dataset_path, seq_len = cfg["dataset"]["path"], cfg["training"]["tokens"]["len"]
        model, checkpoints = cfg["model"], cfg["checkpoints"]
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{path} lacks {e}; it is not a seqax run's config") from None
    # Runs trained before model.attention_block existed: sampling attends over its KV cache
    # without blocks, and one block of the training length is the attention they were trained with.
    model = {"attention_block": seq_len, **model} if isinstance(model, dict) else model
    model, checkpoints = (config_from_dict(ModelConfig, model, "model."),
                          config_from_dict(CheckpointConfig, checkpoints, "checkpoints."))
    return RunConfig(model, checkpoints, dataset_path, seq_len, int((cfg.get("mesh") or {}).get("c", 1)))


def paths_read(run_dir: str, dataset: str | None = None) -> list[tuple[str, str]]:
    """What a reader of the run reads, named for outputs.check_output_apart: the run directory, its
    checkpoints (a link may put them elsewhere) and the dataset (`dataset`, default the run's)."""
    dataset = dataset or load_run_config(run_dir).dataset_path
    checkpoints = os.path.join(run_dir, "checkpoints")
    return [(f"the run directory {run_dir!r} (--run-dir)", run_dir), (f"its checkpoints {checkpoints!r}", checkpoints),
            (f"the dataset {dataset!r}", dataset)]


def default_mesh_shape(h: ModelConfig, weights, devices: int) -> tuple[int, int]:
    """(d, t): the most tensor parallelism that the weights (annotated as `weights`, train.Model) allow
    on this many devices; (devices, 1) when none does."""
    fitting = [t for t in range(1, devices + 1)
               if devices % t == 0 and mesh_misfit(h, weights, devices // t, t) is None]
    t = max(fitting, default=1)
    return devices // t, t


def run_mesh(h: ModelConfig, weights, d: int | None, t: int | None) -> jax.sharding.Mesh:
    """The mesh of all devices for reading the run's weights (annotated as `weights`, train.Model):
    (d, t) as given (--mesh-d and --mesh-t), or default_mesh_shape's when either is None."""
    n = jax.device_count()
    if d is None or t is None:
        d, t = default_mesh_shape(h, weights, n)
    if d * t != n:
        raise ConfigError(f"--mesh-d {d} x --mesh-t {t} must equal the {n} devices")
    misfit = mesh_misfit(h, weights, d, t)
    if misfit:
        raise ConfigError(f"{misfit}; choose --mesh-d/--mesh-t that divide it")
    return make_mesh(d, t)


def load_weights(run_dir: str, run: RunConfig, mesh, init_weights, weights, step: int | None = None):
    """(step, weights) of checkpoint `step` (default: the newest committed one), read only, placed on
    `mesh`: `init_weights(model config, key)` gives the weights' shapes (train.init_weights, only
    traced) and `weights` their annotation (train.Model)."""
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), run.checkpoints)
    shapes = {"weights": jax.eval_shape(lambda: init_weights(run.model, jax.random.key(0)))}
    try:
        for attempt in range(NEWEST_ATTEMPTS):
            chosen = checkpointer.latest_step() if step is None else step
            if chosen is None:
                raise ConfigError(f"{run_dir}/checkpoints holds no committed checkpoint")
            try:
                return chosen, checkpointer.read(chosen, shapes, {"weights": make_shardings(weights, mesh)})["weights"]
            except CheckpointRemoved:
                # Beside a live run, the newest may be rotated away while it is read: the newest is then newer.
                if step is not None or attempt == NEWEST_ATTEMPTS - 1:
                    raise
    finally:
        checkpointer.close()
