"""The configuration of a run and the errors a user can fix. A leaf: imports no module of ours.

Every key without a default is required (configs/*.yaml); the few with a default (mesh.c, Muon's,
evaluation, model.attention_kernel) may be left out, as configs written before they existed do. A
key's comment says what it sets. Configuration sets numbers and paths; the few keys that pick a
behaviour (dataset.packed, checkpoints.compression, distributed.*) choose what is read or written,
and model.attention_kernel which kernel computes the same attention, never which model or step
runs. Dimension letters (M, Q, K, D, F, V, B, L) are the ones train.py's docstring names.
"""

import dataclasses
import difflib
import os
import sys
import typing

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

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


class OutputError(SeqaxError):
    """A file that a run must write could not be written (a full disk, a read-only one, no permission)."""


class DivergedError(SeqaxError):
    """Training reached a loss, gradient norm or state that is not finite (NaN or inf) at `step`."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


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
    # which kernel computes attention (the same math, up to rounding): "auto" (Pallas on GPUs and TPUs,
    # blockwise on CPUs), "pallas" (the device's: Mosaic GPU's on a Hopper where d_head and attention_block
    # are multiples of 64, else Triton's; Mosaic TPU's), "pallas_triton" or "pallas_hopper" (one GPU lowering,
    # to compare them), "blockwise" or "reference" (readable, autodiff's gradient, slow; README)
    attention_kernel: str = "auto"
    # the type matmuls multiply in (products accumulate in float32): "bfloat16", the fast path on every
    # accelerator; "float8", the linear layers', experts' and unembedding's matmuls in e4m3 (their output
    # gradients too, the logits' in e5m2), each operand scaled by its amax or a bound on it (shardlib/float8.py;
    # twice bfloat16's rate on Hopper and Blackwell), their operands kept and sent as bfloat16, every other
    # matmul in bfloat16; or "float32", exact up to the order of sums (the tests check the math that way)
    matmul_dtype: str = "bfloat16"
    # A mixture of experts beside the dense SwiGLU of d_ff (README, "Mixture of experts"): each token goes
    # through the experts_per_token of `experts` SwiGLU experts of expert_d_ff that its router picks. 0
    # experts (the default) is the dense model; d_ff: 0 leaves the experts alone, d_ff > 0 is a shared expert.
    experts: int = 0  # E
    experts_per_token: int = 0  # top-k; at least 1 and at most `experts` when there are experts
    expert_d_ff: int = 0  # H
    expert_block: int = 64  # rows per block of the experts' grouped SwiGLU (speed, not the math)
    # the loss over each device's positions (training.tokens.len / mesh.c) in this many parts, one part's logits at
    # a time, each part's gradient computed with its loss (memory, not the math: train.cross_entropy_sum)
    loss_parts: int = 1

    @property
    def operand_dtype(self) -> str:
        """The type matmul operands are kept and sent in: matmul_dtype's, bfloat16 for float8 (whose
        matmuls cast their operands themselves: einsum_unreduced's multiply_in)."""
        return "bfloat16" if self.matmul_dtype == "float8" else self.matmul_dtype


# attention.training_attention's
ATTENTION_KERNELS = ("auto", "pallas", "pallas_triton", "pallas_hopper", "blockwise", "reference")
MATMUL_DTYPES = ("bfloat16", "float8", "float32")

# The model's dimensions (train.py's legend) and the keys of the `model:` section that size them:
# validation.py and memory.py read a dimension's size through this table.
MODEL_DIMENSIONS = {"M": "d_model", "Q": "n_q_per_kv", "K": "n_kv", "D": "d_head", "F": "d_ff", "V": "vocab",
                    "E": "experts", "H": "expert_d_ff", "layers": "layers"}


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
    # Load balance of the experts (model.experts > 0), DeepSeek-V3's (Liu et al. 2024, sec. 2.1.2): each
    # expert's selection bias moves by this much a step, up when it got fewer tokens than the mean, down
    # when more; and the weight of the sequence-wise balance loss (0 turns it off; DeepSeek-V3 used 1e-4).
    expert_bias_rate: float = 0.001
    expert_balance_loss: float = 0.0


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

    keep: int  # newest complete checkpoints kept, at least 2 (checkpoint.KEEP_AT_LEAST); older ones deleted (0: all)
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
    """The `logging:` section: where a run reports besides its run directory (records.py)."""

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
    logging: LoggingConfig  # optional reporting to Weights & Biases (records.py, docs/observability.md)
    evaluation: EvaluationConfig = EvaluationConfig()  # multiple-choice tasks (evaluation.py); none by default
    profile_steps: int = 2  # steps traced by the profiler after each process's first (0: no profile)


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
        raise ConfigError(f"unknown config key {where}{unknown[0]}{nearest(unknown[0], fields, where)} "
                          f"(known keys here: {', '.join(sorted(fields))})")
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


def defaulted_keys(cls=None, where: str = "") -> set[str]:
    """The dotted keys of Config (or the dataclass `cls`) that have a default, nested ones included."""
    keys = set()
    for f in dataclasses.fields(cls or Config):
        kind = typing.get_type_hints(cls or Config)[f.name]
        if dataclasses.is_dataclass(kind):
            keys |= defaulted_keys(kind, f"{where}{f.name}.")
        elif f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            keys.add(where + f.name)
    return keys


def addable(overrides: list[str]) -> list[str]:
    """`overrides` with each plain `key=value` of a key that has a default written `++key=value` (set it,
    whether or not the YAML has it): a documented key needs no `+` in a config written before it existed."""
    keys = defaulted_keys()
    return [f"++{o}" if o.split("=", 1)[0] in keys and not o.startswith(("+", "~", "-")) else o for o in overrides]


def load_config(name: str, overrides: list[str]) -> Config:
    """configs/<name>.yaml with command-line style overrides, as `python -m train` sees it."""
    try:
        cfg = compose(name, addable(overrides), CONFIGS)
        return config_from_dict(Config, OmegaConf.to_container(cfg, resolve=True))
    except (HydraException, OmegaConfBaseException) as e:
        raise hydra_error(e, name, CONFIGS) from None


def compose(name: str, overrides: list[str], config_dir: str):
    GlobalHydra.instance().clear()  # a failed hydra.main leaves hydra initialized
    with hydra.initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra.compose(config_name=name, overrides=overrides)


def run_hydra(task):
    """Runs `task(config as an omegaconf DictConfig)` on the config that hydra.main composes from the
    command line (`--config-name=NAME [key=value ...]`; --config-path, --cfg, --help and the rest of
    hydra's flags work as usual). Hydra's errors of composing it (a mistyped key, a config that does
    not exist, an override it cannot parse) are raised as a ConfigError: one line naming the key or
    config and the nearest valid one, where hydra would print several lines of its own and exit 1."""
    # Hydra reads a relative --config-path from the directory of the file that calls hydra.main: this
    # one, where it was train.py's, the repository root. Made absolute from there, it keeps that meaning.
    argv = addable(rooted_config_path(sys.argv[1:], os.path.dirname(CONFIGS)))
    name, config_dir = flag(argv, "--config-name", "-cn"), flag(argv, "--config-path", "-cp") or CONFIGS

    failed = []

    def task_past_hydra(cfg):  # hydra would print a line of its own before raising the task's error
        try:
            if name is None:
                raise no_config_given(config_dir)
            task(cfg)
        except Exception as e:
            failed.append(e)

    previous, command_line = os.environ.get("HYDRA_FULL_ERROR"), sys.argv
    os.environ["HYDRA_FULL_ERROR"] = "1"  # hydra raises its errors to us instead of printing them
    sys.argv = command_line[:1] + argv  # what hydra.main parses
    try:
        hydra.main(config_path=CONFIGS, config_name=None, version_base=None)(task_past_hydra)()
    except (HydraException, OmegaConfBaseException) as e:
        raise hydra_error(e, name, config_dir) from None
    finally:
        sys.argv = command_line
        if previous is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    if failed:
        raise failed[0]


def rooted_config_path(argv: list[str], root: str) -> list[str]:
    """`argv` with a relative --config-path (or -cp) value joined to `root`."""
    out = list(argv)
    for i, arg in enumerate(out):
        for name in ("--config-path", "-cp"):
            if arg.startswith(name + "=") and not os.path.isabs(arg[len(name) + 1 :]):
                out[i] = f"{name}={os.path.join(root, arg[len(name) + 1 :])}"
            elif arg == name and i + 1 < len(out) and not os.path.isabs(out[i + 1]):
                out[i + 1] = os.path.join(root, out[i + 1])
    return out


def flag(argv: list[str], *names: str) -> str | None:
    """The value of a command-line flag given as `--name=VALUE` or `--name VALUE` (the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg.startswith(name + "="):
                value = arg[len(name) + 1 :]
            elif arg == name and i + 1 < len(argv):
                value = argv[i + 1]
    return value


def config_names(config_dir: str) -> list[str]:
    """The configs that --config-name can name: the YAML files at the top of `config_dir`."""
    names = os.listdir(config_dir) if os.path.isdir(config_dir) else []
    return sorted(n.removesuffix(".yaml") for n in names if n.endswith(".yaml"))


def nearest(word: str, candidates, prefix: str = "") -> str:
    """`; did you mean X?` for the candidate closest to `word` (difflib's ratio), or "" when none is close."""
    found = difflib.get_close_matches(word, list(candidates), n=1)
    return f"; did you mean {prefix}{found[0]}?" if found else ""


def dotted_keys(node, where: str = "") -> list[str]:
    """Every key of a composed config, nested ones as `section.key`."""
    if not isinstance(node, dict):
        return []
    return [k for key, value in node.items() for k in [f"{where}{key}", *dotted_keys(value, f"{where}{key}.")]]


def hydra_error(error: Exception, name: str | None, config_dir: str) -> ConfigError:
    """Hydra's (or omegaconf's) error of composing config `name` from `config_dir`, as one line."""
    if name is None:
        return no_config_given(config_dir)
    if isinstance(error, MissingConfigException):
        missing, names = error.missing_cfg_file or name, config_names(config_dir)
        return ConfigError(f"there is no config {missing!r} in {config_dir}{nearest(str(missing), names)} "
                           f"(the configs: {', '.join(names)})")
    lines = [line.strip().rstrip(".") for line in str(error).strip().splitlines() if line.strip()]
    if isinstance(error, OverrideParseException):
        return ConfigError(f"cannot read the override {error.override!r}: {lines[0] if lines else error}; "
                           "write overrides as key=value (hydra's override grammar)")
    key = getattr(error.__cause__, "full_key", None)  # an override of a key the config does not have
    try:
        keys = dotted_keys(OmegaConf.to_container(compose(name, [], config_dir)))
    except (HydraException, OmegaConfBaseException):
        keys = []
    if key and keys and key not in keys:
        return ConfigError(f"config {name} has no key {key}{nearest(key, keys)}")
    return ConfigError(f"config {name}: {'; '.join(lines) or type(error).__name__}")


def no_config_given(config_dir: str) -> ConfigError:
    return ConfigError(f"no config given: add --config-name=NAME, one of {', '.join(config_names(config_dir))}")
