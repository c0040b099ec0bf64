"""Small additions to JAX: explicit activation saving and string-keyed RNG."""

import hashlib
from functools import partial

import jax
from jax.ad_checkpoint import checkpoint_name

from seqax.shardlib.bits import is_narrow_float, through_bits
from seqax.shardlib.shardops import FLOAT8_OPERAND_NAME

SAVED_NAME = "seqax_save_for_backward"


def save_for_backward(x):
    """Marks `x` to be kept for the backward pass of an `explicit_activation_checkpointing`
    function. Every other intermediate is recomputed."""
    return _saved_as_bits(x) if is_narrow_float(x) else checkpoint_name(x, SAVED_NAME)


def save_in_forward_rule(x):
    """save_for_backward inside a custom_vjp's forward rule, which is never differentiated: the
    same saving without save_for_backward's custom_jvp, a call whose inside the
    rematerialization policy does not see (the value would be recomputed, not kept)."""
    return _bits_saved(x)


# A value saved inside a lax.scan is written into a stack, one iteration at a time: a bfloat16
# value is saved as its bits (shardlib/bits.py), so that XLA:CPU does not widen the whole stack
# to float32 for every write (the layers ran as a scan until they became a Python loop; a
# bitcast costs nothing, so the bits stay).
# The gradient passes through unchanged.


def _bits_saved(x):
    return through_bits(partial(checkpoint_name, name=SAVED_NAME), x)


@jax.custom_jvp
def _saved_as_bits(x):
    return _bits_saved(x)


@_saved_as_bits.defjvp
def _saved_as_bits_jvp(primals, tangents):
    return _bits_saved(primals[0]), tangents[0]  # the name in plain sight of the remat policy


def explicit_activation_checkpointing(f):
    """Remat `f` so that its backward pass keeps exactly its arguments and the values marked
    with `save_for_backward`, and the float8 casts of a float8 einsum's first operand (shardops.einsum_unreduced
    keeps those by name)."""
    return jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(SAVED_NAME, FLOAT8_OPERAND_NAME))


def fold_in_str(key: jax.Array, name: str) -> jax.Array:
    """A new key for `name`; stable across processes and Python runs (unlike `hash`)."""
    digest = hashlib.sha256(name.encode()).digest()
    return jax.random.fold_in(key, int.from_bytes(digest[:4], "little"))
