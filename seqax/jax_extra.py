"""Small additions to JAX: explicit activation saving and string-keyed RNG."""

import hashlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

SAVED_NAME = "seqax_save_for_backward"


def save_for_backward(x):
    """Marks `x` to be kept for the backward pass of an `explicit_activation_checkpointing`
    function. Every other intermediate is recomputed."""
    return _saved_as_bits(x) if is_16_bit_float(x) else checkpoint_name(x, SAVED_NAME)


def save_in_forward_rule(x):
    """save_for_backward inside a custom_vjp's forward rule, which is never differentiated: the
    same saving without save_for_backward's custom_jvp, a call whose inside the
    rematerialization policy does not see (the value would be recomputed, not kept)."""
    return _bits_saved(x) if is_16_bit_float(x) else checkpoint_name(x, SAVED_NAME)


# A value saved inside the layers' scan is written into a [layers, ...] stack, one layer at a
# time. XLA:CPU has no 16-bit float dynamic-update-slice: it widens the whole stack to float32
# and back for every layer's write, work (and temporary memory) that grows with the number of
# layers. Saving the bits as an unsigned integer of the same width makes the writes and reads
# plain copies (as they are on GPUs and TPUs); the gradient passes through unchanged.


def is_16_bit_float(x) -> bool:
    """Whether x is a 16-bit float (bfloat16, float16), which XLA:CPU widens to float32 where a
    loop or a stack slices or updates it: such values are better held as their bits (as_bits)."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2


def as_bits(x):
    """x's bit pattern as the unsigned integer type of its width (a bitcast: no copy); undone by
    lax.bitcast_convert_type(bits, x.dtype)."""
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _bits_saved(x):
    return lax.bitcast_convert_type(checkpoint_name(as_bits(x), SAVED_NAME), x.dtype)


@jax.custom_jvp
def _saved_as_bits(x):
    return _bits_saved(x)


@_saved_as_bits.defjvp
def _saved_as_bits_jvp(primals, tangents):
    return _bits_saved(primals[0]), tangents[0]  # the name in plain sight of the remat policy


def explicit_activation_checkpointing(f):
    """Remat `f` so that its backward pass keeps exactly its arguments and the values marked
    with `save_for_backward`."""
    return jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(SAVED_NAME))


def fold_in_str(key: jax.Array, name: str) -> jax.Array:
    """A new key for `name`; stable across processes and Python runs (unlike `hash`)."""
    digest = hashlib.sha256(name.encode()).digest()
    return jax.random.fold_in(key, int.from_bytes(digest[:4], "little"))
