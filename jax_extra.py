"""Small additions to JAX: explicit activation saving and string-keyed RNG."""

import hashlib

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
