"""Small additions to JAX: explicit activation saving, string-keyed RNG, typed configs."""

import dataclasses
import hashlib
import typing

import jax
from jax.ad_checkpoint import checkpoint_name

SAVED_NAME = "seqax_save_for_backward"


def save_for_backward(x):
    """Marks `x` to be kept for the backward pass of an `explicit_activation_checkpointing`
    function. Every other intermediate is recomputed."""
    return checkpoint_name(x, SAVED_NAME)


def explicit_activation_checkpointing(f):
    """Remat `f` so that its backward pass keeps exactly its arguments and the values marked
    with `save_for_backward`."""
    return jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(SAVED_NAME))


def fold_in_str(key: jax.Array, name: str) -> jax.Array:
    """A new key for `name`; stable across processes and Python runs (unlike `hash`)."""
    digest = hashlib.sha256(name.encode()).digest()
    return jax.random.fold_in(key, int.from_bytes(digest[:4], "little"))


class ConfigError(ValueError):
    """The configuration does not fit the program; the message names the key and the fix."""


def config_from_dict(cls, values, where: str = ""):
    """Builds the frozen dataclass `cls` from nested dicts; every field is required and every
    key must be a field (a typo is an error, not silently ignored)."""
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
        if name not in values:
            raise ConfigError(f"config is missing key {key} (set it in the YAML or with +{key}=...)")
        t, v = hints[name], values[name]
        if dataclasses.is_dataclass(t):
            out[name] = config_from_dict(t, v, f"{key}.")
            continue
        if t is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise ConfigError(f"config key {key} must be {t.__name__}, got {v!r}")
        out[name] = v
    return cls(**out)
