"""A run's configuration checked against the devices, the data and the model's weights, before
anything is compiled: every mismatch stops the program with one line naming the key and the fix.
"""

import dataclasses
import math

from seqax.config import ATTENTION_KERNELS, MATMUL_DTYPES, MODEL_DIMENSIONS, Config, ConfigError, ModelConfig
from seqax.shardlib.shardtypes import leaf_dims


def mesh_misfit(m: ModelConfig, weights, d: int, t: int, c: int = 1) -> str | None:
    """The first weight dimension that a (d, t, c) mesh does not split evenly, as 'model.KEY=N is
    not divisible by mesh.AXIS=N', or None when every split dimension divides. Which mesh axes split
    which dimension is read from `weights`, the weights' annotation (train.Model)."""
    mesh = {"d": d, "t": t, "c": c}
    for dims in leaf_dims(weights):
        for dim in dims:
            axes = [axis for axis in dim.axes if mesh[axis] > 1]
            key = MODEL_DIMENSIONS.get(dim.name)
            if key is None or not axes or getattr(m, key) % math.prod(mesh[axis] for axis in axes) == 0:
                continue
            shown = " x ".join(f"mesh.{axis}" for axis in axes)
            return f"model.{key}={getattr(m, key)} is not divisible by {shown}={math.prod(mesh[a] for a in axes)}"
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


def validate_config(cfg: Config, n_devices: int, max_token_id: int, weights):
    """Every mismatch between config, devices, data and the weights' annotation `weights`
    (train.Model), found before any compilation."""
    m, d, t, c = cfg.model, cfg.mesh.d, cfg.mesh.t, cfg.mesh.c
    if min(d, t, c) < 1:
        raise ConfigError(f"mesh.d={d}, mesh.t={t} and mesh.c={c} must be positive; choose them with a product of "
                          f"{n_devices}, the devices")
    if d * t * c != n_devices:
        shown, keys = ((f"mesh.d={d} x mesh.t={t}", "mesh.d and mesh.t") if c == 1
                       else (f"mesh.d={d} x mesh.t={t} x mesh.c={c}", "mesh.d, mesh.t and mesh.c"))
        raise ConfigError(f"{shown} = {d * t * c} must equal the {n_devices} devices; "
                          f"choose {keys} whose product is {n_devices}, or run on {d * t * c} devices: on a CPU, set "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={d * t * c} (one process) or use "
                          f"`python -m tools.launch_local --processes P --devices-per-process K` (P x K = {d * t * c})")
    for key, value in (("d_model", m.d_model), ("n_kv", m.n_kv), ("vocab", m.vocab)):
        if value <= 0:
            raise ConfigError(f"model.{key}={value} must be positive")
    check_experts(m)
    if m.experts % d:
        raise ConfigError(f"model.experts={m.experts} is not divisible by mesh.d={d}: the experts are split over d "
                          "(expert parallelism); make experts a multiple of mesh.d, or change the mesh")
    misfit = mesh_misfit(m, weights, d, t, c)
    if misfit:
        raise ConfigError(f"{misfit}; make it a multiple of the mesh axis, or change the mesh")
    if cfg.training.tokens.batch <= 0 or cfg.training.tokens.batch % d:
        raise ConfigError(f"training.tokens.batch={cfg.training.tokens.batch} is not divisible by mesh.d={d}; "
                          f"make it a positive multiple of {d}")
    check_attention_blocks(m, cfg.training.tokens.len, c)
    if m.loss_parts < 1 or (cfg.training.tokens.len // c) % m.loss_parts:
        raise ConfigError(f"model.loss_parts={m.loss_parts} must divide each device's positions, training.tokens.len "
                          f"/ mesh.c = {cfg.training.tokens.len // c}")
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
    if cfg.profile_steps < 0:
        raise ConfigError(f"profile_steps={cfg.profile_steps} must not be negative (0 turns the profile off)")
    check_values(cfg)


def check_experts(m: ModelConfig):
    """The feed-forward part: a dense SwiGLU (d_ff > 0), experts (experts > 0), or both (a shared expert)."""
    if m.d_ff < 0 or m.experts < 0 or (m.d_ff == 0 and m.experts == 0):
        raise ConfigError(f"model.d_ff={m.d_ff} and model.experts={m.experts} leave no feed-forward layer; "
                          "set d_ff > 0 (dense), experts > 0 (a mixture of experts), or both")
    if m.experts == 0 and (m.experts_per_token or m.expert_d_ff):
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} and model.expert_d_ff={m.expert_d_ff} "
                          "need model.experts > 0; set experts, or leave both at 0 for the dense model")
    if m.experts > 0 and not 1 <= m.experts_per_token <= m.experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} must be in 1..model.experts={m.experts}")
    if m.experts > 0 and (m.expert_d_ff <= 0 or m.expert_block <= 0):
        raise ConfigError(f"model.expert_d_ff={m.expert_d_ff} and model.expert_block={m.expert_block} must be "
                          "positive with experts")


LEVELS = {"zstd": (1, 22), "blosc": (0, 9)}


def check_finite(section, where: str = ""):
    """Every float of a config section and its subsections is a finite number: NaN passes (fails) every
    comparison a range check makes, and a run with a NaN or an infinite rate diverges at its first step."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{where}{field.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}{field.name}={value} must be a finite number")


def check_values(cfg: Config):
    """The numbers that only the devices' math would otherwise reject, late or silently."""
    m, tr = cfg.model, cfg.training
    check_finite(cfg)
    for key, value in (("training.seed", tr.seed), ("dataset.seed", cfg.dataset.seed)):
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"{key}={value} does not fit in 64 bits; choose a seed in [0, 2**63)")
    for key, value in (("rope_base", m.rope_base), ("norm_eps", m.norm_eps)):
        if not value > 0:
            raise ConfigError(f"model.{key}={value} must be positive (typical: 10000 and 1e-5)")
    for key, value in (("layers", m.layers), ("d_head", m.d_head), ("n_q_per_kv", m.n_q_per_kv)):
        if value <= 0:
            raise ConfigError(f"model.{key}={value} must be positive; set it to 1 or more")
    if m.attention_kernel not in ATTENTION_KERNELS:
        raise ConfigError(f"model.attention_kernel={m.attention_kernel!r} is not a kernel; choose one of "
                          f"{', '.join(ATTENTION_KERNELS)}")
    if m.matmul_dtype not in MATMUL_DTYPES:
        raise ConfigError(f"model.matmul_dtype={m.matmul_dtype!r} is not a matmul type; choose one of "
                          f"{', '.join(MATMUL_DTYPES)}")
    if tr.learning_rate < 0:
        raise ConfigError(f"training.learning_rate={tr.learning_rate} must not be negative")
    for key, value in (("adam_b1", tr.adam_b1), ("adam_b2", tr.adam_b2)):
        if not 0 <= value < 1:
            raise ConfigError(f"training.{key}={value} must be in [0, 1) (typical: 0.9 and 0.95)")
    if not tr.adam_eps > 0:
        raise ConfigError(f"training.adam_eps={tr.adam_eps} must be positive (typical: 1e-8)")
    for key in ("weight_decay", "muon_weight_decay", "muon_learning_rate", "expert_bias_rate", "expert_balance_loss"):
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
