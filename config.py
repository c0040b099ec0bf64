"""The configuration of a run: numbers and paths only, never code paths (train.py reads it).

Every key is required (configs/*.yaml); a key's comment says what it sets. Dimension letters
(M, Q, K, D, F, V, B, L) are the ones train.py's docstring names.
"""

import dataclasses
import os

import hydra
from omegaconf import OmegaConf

from checkpoint import CheckpointConfig
from data_loader import DatasetConfig
from jax_extra import ConfigError, config_from_dict
from multihost import DistributedConfig


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
    weight_decay: float  # decoupled (AdamW, Loshchilov & Hutter 2019), on every weight
    grad_clip: float  # global L2 norm


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    d: int
    t: int


@dataclasses.dataclass(frozen=True)
class PathsConfig:
    root_working_dir: str
    model_name: str


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


def validate_config(h: Config, n_devices: int, max_token_id: int):
    """Every mismatch between config, devices and data, found before any compilation."""
    m, d, t = h.model, h.mesh.d, h.mesh.t
    if d < 1 or t < 1 or d * t != n_devices:
        raise ConfigError(f"mesh.d={d} x mesh.t={t} = {d * t} must equal the {n_devices} devices; choose mesh.d and mesh.t whose product is {n_devices}")
    divisible = [
        ("training.tokens.batch", h.training.tokens.batch, "mesh.d", d),
        ("model.d_model", m.d_model, "mesh.d", d),
        ("model.n_kv", m.n_kv, "mesh.t", t),
        ("model.d_ff", m.d_ff, "mesh.t", t),
        ("model.vocab", m.vocab, "mesh.t", t),
    ]
    for key, value, axis_key, axis in divisible:
        if value <= 0 or value % axis:
            raise ConfigError(f"{key}={value} is not divisible by {axis_key}={axis}; make it a positive multiple of {axis}")
    if m.attention_block < 1 or h.training.tokens.len % m.attention_block:
        raise ConfigError(f"model.attention_block={m.attention_block} must divide training.tokens.len={h.training.tokens.len}")
    if m.d_head % 2:
        raise ConfigError(f"model.d_head={m.d_head} must be even for RoPE")
    if m.vocab <= max_token_id:
        raise ConfigError(f"model.vocab={m.vocab} is too small for the dataset's max_token_id {max_token_id}; set model.vocab to at least {max_token_id + 1}")
    if h.training.steps < 1 or h.training.warmup_steps < 0 or h.training.tokens.len < 1:
        raise ConfigError("training.steps and training.tokens.len must be positive and training.warmup_steps not negative")
    if h.checkpoint_interval < 0:
        raise ConfigError(f"checkpoint_interval={h.checkpoint_interval} must be 0 (save only at the end and on SIGTERM) or a positive step count")
    if h.eval_interval < 0 or h.eval_batches < 0:
        raise ConfigError(f"eval_interval={h.eval_interval} and eval_batches={h.eval_batches} must not be negative (eval_batches=0 turns evaluation off)")


def load_config(name: str, overrides: list[str]) -> Config:
    """configs/<name>.yaml with command-line style overrides, as `python -m train` sees it."""
    with hydra.initialize_config_dir(config_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"), version_base=None):
        cfg = hydra.compose(config_name=name, overrides=overrides)
    return config_from_dict(Config, OmegaConf.to_container(cfg, resolve=True))
