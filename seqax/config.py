"""The configuration of a run and the errors a user can fix. A leaf: imports no module of ours.

Every key is required (configs/*.yaml); a key's comment says what it sets. Configuration sets
numbers and paths; the few keys that pick a behaviour (dataset.packed, checkpoints.compression,
distributed.*) choose what is read or written, never which model or step runs. Dimension letters
(M, Q, K, D, F, V, B, L) are the ones train.py's docstring names.
"""

import dataclasses
import os
import typing

import hydra
from omegaconf import OmegaConf

# ---------------------------------------------------------------------------------------------
# Errors. Each entry point prints a SeqaxError as one line (`seqax: error: ...`) and exits 2;
# anything else is a bug and keeps its traceback.


class SeqaxError(Exception):
    """A failure the user can fix; the message names the value and what would fix it."""


class ConfigError(SeqaxError):
    """The configuration (or a command-line flag) does not fit the program, the data or the devices."""


class DatasetError(SeqaxError):
    """The dataset on disk is missing or malformed; the message names the path and the problem."""


class TokenizerError(SeqaxError):
    """The tokenizer cannot be loaded or does not fit flat-tokens."""


class CheckpointError(SeqaxError):
    """A checkpoint does not fit the state (array names, shapes, dtypes) or none is readable."""


class DistributedError(SeqaxError):
    """The processes could not form a run (bad settings, or a peer that never connected)."""


# ---------------------------------------------------------------------------------------------
# The sections of a training config.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int  # M
    n_q_per_kv: int  # Q
    n_kv: int  # K
    d_head: int  # D
    d_ff: int  # F
    layers: int
    vocab: int  # V
    rope_base: float  # RoPE rotates dims (i, i + D/2) at rate base^(-2i/D) (RoFormer, Su et al. 2021, eq. 15)
    norm_eps: float
    attention_block: int  # positions per attention block; divides training.tokens.len (speed and memory, not the math)


@dataclasses.dataclass(frozen=True)
class TokensConfig:
    batch: int  # B, sequences per step (global)
    len: int  # L


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    steps: int
    tokens: TokensConfig
    learning_rate: float  # peak, reached at the end of warmup
    warmup_steps: int
    final_learning_rate_fraction: float  # cosine decays to this fraction of the peak
    seed: int
    adam_b1: float
    adam_b2: float
    adam_eps: float
    weight_decay: float  # AdamW's, decoupled (Loshchilov & Hutter 2019): w -= learning_rate * weight_decay * w
    grad_clip: float  # global L2 norm
    # Muon's (train.MUON names its weights), with Jordan et al. 2024's defaults; the same schedule.
    muon_learning_rate: float = 0.02  # peak
    muon_momentum: float = 0.95  # Nesterov
    muon_weight_decay: float = 0.0  # decoupled, as AdamW's: w -= muon_learning_rate * muon_weight_decay * w


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    d: int  # devices over the batch and (FSDP) the weights
    t: int  # devices over heads, d_ff and vocabulary (tensor parallelism)
    c: int = 1  # devices over each row's positions (context parallelism) and, with d, the weights


@dataclasses.dataclass(frozen=True)
class PathsConfig:
    root_working_dir: str
    model_name: str  # the run directory is root_working_dir/model_name


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """The `dataset:` section: what data_loader.py reads and in which order."""

    path: str  # a flat-tokens zarr (docs/flat-tokens.md)
    packed: bool  # true: rows are L consecutive tokens; false: one document per row, padded
    seed: int  # of the shuffle; the batch of a step depends on it and nothing else random
    streams: int  # S, independent regions of the shuffled epoch that every batch draws from
    read_block_tokens: int  # K = max(1, read_block_tokens // L) rows are read together
    shuffle_buffer_tokens: int  # W = max(K, shuffle_buffer_tokens // L) rows shuffled together
    prefetch: int  # batches prepared ahead by a background thread; 0 prepares in batch()


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The `checkpoints:` section (the interval is `checkpoint_interval`), read by checkpoint.py."""

    keep: int  # newest complete checkpoints kept; older ones are deleted (0 keeps all)
    compression: str  # none, zstd or blosc
    level: int  # compression level: zstd 1..22, blosc 0..9 (ignored for none)
    threads: int  # chunks read or written in parallel by each process


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The `distributed:` section, read by multihost.py. Empty values mean: the environment
    variable, else what JAX detects on the cluster; with nothing set the run is one process."""

    coordinator_address: str  # "host:port" of process 0; "": $JAX_COORDINATOR_ADDRESS, else detected
    num_processes: int  # 0: $JAX_NUM_PROCESSES, else the cluster's task count, else 1 (no jax.distributed)
    process_id: int  # -1: $JAX_PROCESS_ID, else detected
    initialization_timeout_seconds: int  # how long a process waits for all the others to connect
    heartbeat_timeout_seconds: int  # a process silent this long is dead: the others stop with an error


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """The `logging:` section: where a run reports besides its run directory (training_io.py)."""

    wandb_project: str  # "": no Weights & Biases; else the W&B project that gets metrics.jsonl's values and the config
    wandb_entity: str  # the W&B user or team of the project ("": your default entity)


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """The `evaluation:` section (evaluation.py); how often is eval_interval, the eval_loss batches eval_batches."""

    tasks: tuple[str, ...] = ()  # multiple-choice task files (JSONL: context, choices, label), scored every evaluation


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    training: TrainingConfig
    mesh: MeshConfig
    paths: PathsConfig
    dataset: DatasetConfig
    checkpoint_interval: int  # steps between checkpoints (0: only at the last step and on SIGTERM)
    checkpoints: CheckpointConfig
    eval_interval: int  # steps between validation losses (0: only after the last step)
    eval_batches: int  # validation batches 0..eval_batches-1 make eval_loss (0: no evaluation)
    distributed: DistributedConfig  # how this process joins the others (multihost.py, docs/multi-host.md)
    logging: LoggingConfig  # optional reporting to Weights & Biases (training_io.py, docs/observability.md)
    evaluation: EvaluationConfig = EvaluationConfig()  # multiple-choice tasks (evaluation.py); none by default


# ---------------------------------------------------------------------------------------------
# Loading and validation.


def config_from_dict(cls, values, where: str = ""):
    """Builds the frozen dataclass `cls` from nested dicts; every field without a default is
    required and every key must be a field (a typo is an error, not silently ignored)."""
    if not isinstance(values, dict):
        raise ConfigError(f"config key {where.rstrip('.') or '<root>'} must be a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {where}{unknown[0]} (known keys here: {', '.join(sorted(fields))})")
    out = {}
    for name in fields:
        key = f"{where}{name}"
        if name not in values and fields[name].default is not dataclasses.MISSING:
            continue  # a key with a default (mesh.c, Muon's, evaluation): older configs lack it
        if name not in values:
            raise ConfigError(f"config is missing key {key} (set it in the YAML or with +{key}=...)")
        t, v = hints[name], values[name]
        if dataclasses.is_dataclass(t):
            out[name] = config_from_dict(t, v, f"{key}.")
            continue
        if typing.get_origin(t) is tuple:  # a list in YAML; a tuple here, so that a Config stays hashable
            item = typing.get_args(t)[0]
            if not isinstance(v, list | tuple) or not all(isinstance(x, item) for x in v):
                raise ConfigError(f"config key {key} must be a list of {item.__name__}, got {v!r}")
            out[name] = tuple(v)
            continue
        if t is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise ConfigError(f"config key {key} must be {t.__name__}, got {v!r}")
        out[name] = v
    return cls(**out)


# The repository's configs/, beside the package: what `python -m train --config-name=NAME` reads.
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def load_config(name: str, overrides: list[str]) -> Config:
    """configs/<name>.yaml with command-line style overrides, as `python -m train` sees it."""
    with hydra.initialize_config_dir(config_dir=CONFIGS,
                                     version_base=None):
        cfg = hydra.compose(config_name=name, overrides=overrides)
    return config_from_dict(Config, OmegaConf.to_container(cfg, resolve=True))


def mesh_misfit(m: ModelConfig, d: int, t: int, c: int = 1) -> str | None:
    """The first weight dimension that a (d, t, c) mesh does not split evenly, as 'model.KEY=N is
    not divisible by mesh.AXIS=N', or None when every sharded dimension divides. The rule of
    the weights' annotations in train.py (M over d and c; heads, d_ff and vocabulary over t)."""
    dc = ("d", d) if c == 1 else ("d x mesh.c", d * c)
    for key, value, (axis, size) in (("d_model", m.d_model, dc), ("n_kv", m.n_kv, ("t", t)), ("d_ff", m.d_ff, ("t", t)),
                                     ("vocab", m.vocab, ("t", t))):
        if value % size:
            return f"model.{key}={value} is not divisible by mesh.{axis}={size}"
    return None


def check_attention_blocks(h: ModelConfig, length: int, c: int = 1):
    """The attention kernel works on whole blocks, each a contiguous run of a row's positions:
    model.attention_block must divide the length, and with mesh.c > 1 each of the 2c chunks of
    the row that data_loader.zigzag_chunks deals out."""
    if h.attention_block < 1 or length % h.attention_block:
        raise ConfigError(f"model.attention_block={h.attention_block} must divide training.tokens.len={length}")
    if c > 1 and length % (2 * c * h.attention_block):
        raise ConfigError(f"training.tokens.len={length} must be a multiple of 2 x mesh.c x model.attention_block = "
                          f"{2 * c * h.attention_block}: with mesh.c={c} each device holds 2 chunks of a row, each of "
                          "whole blocks; lower model.attention_block or change the length")


def validate_config(cfg: Config, n_devices: int, max_token_id: int):
    """Every mismatch between config, devices and data, found before any compilation."""
    m, d, t, c = cfg.model, cfg.mesh.d, cfg.mesh.t, cfg.mesh.c
    if d < 1 or t < 1 or c < 1 or d * t * c != n_devices:
        shown, keys = ((f"mesh.d={d} x mesh.t={t}", "mesh.d and mesh.t") if c == 1
                       else (f"mesh.d={d} x mesh.t={t} x mesh.c={c}", "mesh.d, mesh.t and mesh.c"))
        raise ConfigError(f"{shown} = {d * t * c} must equal the {n_devices} devices; "
                          f"choose {keys} whose product is {n_devices}")
    for key, value in (("d_model", m.d_model), ("n_kv", m.n_kv), ("d_ff", m.d_ff), ("vocab", m.vocab)):
        if value <= 0:
            raise ConfigError(f"model.{key}={value} must be positive")
    misfit = mesh_misfit(m, d, t, c)
    if misfit:
        raise ConfigError(f"{misfit}; make it a multiple of the mesh axis, or change the mesh")
    if cfg.training.tokens.batch <= 0 or cfg.training.tokens.batch % d:
        raise ConfigError(f"training.tokens.batch={cfg.training.tokens.batch} is not divisible by mesh.d={d}; "
                          f"make it a positive multiple of {d}")
    check_attention_blocks(m, cfg.training.tokens.len, c)
    if m.d_head % 2:
        raise ConfigError(f"model.d_head={m.d_head} must be even for RoPE")
    if m.vocab <= max_token_id:
        raise ConfigError(f"model.vocab={m.vocab} is too small for the dataset's max_token_id {max_token_id}; "
                          f"set model.vocab to at least {max_token_id + 1}")
    if cfg.training.steps < 1 or cfg.training.warmup_steps < 0 or cfg.training.tokens.len < 1:
        raise ConfigError("training.steps and training.tokens.len must be positive and "
                          "training.warmup_steps not negative")
    if cfg.checkpoint_interval < 0:
        raise ConfigError(f"checkpoint_interval={cfg.checkpoint_interval} must be 0 (save only at the end and on "
                          "SIGTERM) or a positive step count")
    if cfg.eval_interval < 0 or cfg.eval_batches < 0:
        raise ConfigError(f"eval_interval={cfg.eval_interval} and eval_batches={cfg.eval_batches} must not be negative "
                          "(eval_batches=0 turns evaluation off)")
    check_values(cfg)


LEVELS = {"zstd": (1, 22), "blosc": (0, 9)}


def check_values(cfg: Config):
    """The numbers that only the devices' math would otherwise reject, late or silently."""
    m, tr = cfg.model, cfg.training
    for key, value in (("layers", m.layers), ("d_head", m.d_head), ("n_q_per_kv", m.n_q_per_kv)):
        if value <= 0:
            raise ConfigError(f"model.{key}={value} must be positive; set it to 1 or more")
    if tr.learning_rate < 0:
        raise ConfigError(f"training.learning_rate={tr.learning_rate} must not be negative")
    for key, value in (("adam_b1", tr.adam_b1), ("adam_b2", tr.adam_b2)):
        if not 0 <= value < 1:
            raise ConfigError(f"training.{key}={value} must be in [0, 1) (typical: 0.9 and 0.95)")
    if not tr.adam_eps > 0:
        raise ConfigError(f"training.adam_eps={tr.adam_eps} must be positive (typical: 1e-8)")
    for key in ("weight_decay", "muon_weight_decay", "muon_learning_rate"):
        if getattr(tr, key) < 0:
            raise ConfigError(f"training.{key}={getattr(tr, key)} must not be negative (0 turns it off)")
    if not 0 <= tr.muon_momentum < 1:
        raise ConfigError(f"training.muon_momentum={tr.muon_momentum} must be in [0, 1) (typical: 0.95)")
    if not tr.grad_clip > 0:
        raise ConfigError(f"training.grad_clip={tr.grad_clip} must be positive (typical: 1.0)")
    if not 0 <= tr.final_learning_rate_fraction <= 1:
        raise ConfigError(f"training.final_learning_rate_fraction={tr.final_learning_rate_fraction} must be in [0, 1]")
    name = cfg.paths.model_name
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"paths.model_name={name!r} must be a plain directory name (not empty, no '/' or '..'); "
                          "set +paths.model_name=RUN")
    c = cfg.checkpoints
    if c.compression in LEVELS and not LEVELS[c.compression][0] <= c.level <= LEVELS[c.compression][1]:
        low, high = LEVELS[c.compression]
        raise ConfigError(f"checkpoints.level={c.level} is out of range for {c.compression}; choose {low}..{high}")
