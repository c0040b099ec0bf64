"""The index bookkeeping of the mixture of experts' dispatch (train.experts_block): which rows a device
sends to which expert's device, in what order, and how the rows it receives are listed in blocks for
grouped_swiglu. Only integer arithmetic on this device's values: every collective, and every matmul,
stays at its call site in train.py.

Names, as train.py's legend: B, L this device's tokens; E experts, `top_k` chosen a token; d, t the mesh
axes' sizes; T the tokens of this device's share of its t group's B L; N = T top_k rows (a token's choice
of an expert); I the devices of d (senders).
"""

import typing

import jax
import jax.numpy as jnp
from jax import lax


class Dispatch(typing.NamedTuple):
    """Where this device's share of its t group's tokens goes: the t devices of a group hold the same
    tokens and each sends the T of them from `first` (the last share padded past B L with rows of no
    expert, E), so that a row is computed once, whole, on any mesh."""

    first: jax.Array  # the share's first token (int32)
    tokens: int  # T
    group: int  # t
    top_k: int
    expert: jax.Array  # [N] int32: each row's expert (E: padding); row r is token first + r // top_k's choice r % top_k
    count: jax.Array  # [E + 1] int32: rows each expert gets from this device (padding last)
    position: jax.Array  # [N] int32: each row's place in expert order (padding last)
    sizes: jax.Array  # [d] int32: rows sent to each device of d (padding rows unsent)

    def share(self, x, fill):
        """This device's T tokens of x [B, L, top_k], padded with `fill`: [T, top_k]."""
        return _share(x, fill, self.first, self.tokens, self.group)

    def rows_in_expert_order(self, x):
        """The rows to send, [N, M], from the tokens x [B, L, M]: each row its token's, in expert order
        (a padding row reads some token; it is never sent)."""
        B, L, M = x.shape
        in_order = jnp.zeros(self.expert.size, jnp.int32).at[self.position].set(
            jnp.arange(self.expert.size, dtype=jnp.int32))
        return x.reshape(B * L, M).at[self.first + in_order // self.top_k].get(mode="clip")

    def in_group_tokens(self, out, tokens: int):
        """This share's token outputs [T, M] placed among the group's `tokens` (B L), zeros in the other
        shares': [B L, M], partial sums over t."""
        placed = jnp.zeros((self.tokens * self.group, out.shape[-1]), out.dtype)
        return lax.dynamic_update_slice_in_dim(placed, out, self.first, 0)[:tokens]


def _share(x, fill, first, T: int, t: int):
    B, L, k = x.shape
    padded = jnp.pad(x.reshape(B * L, k), ((0, T * t - B * L), (0, 0)), constant_values=fill)
    return lax.dynamic_slice_in_dim(padded, first, T)


def plan_dispatch(chosen, experts: int, d: int, t: int, t_index) -> Dispatch:
    """The Dispatch of this device's share of the tokens whose chosen experts are `chosen` [B, L, top_k],
    with `experts` experts spread over the d devices (experts / d each) and t devices to a group."""
    B, L, top_k = chosen.shape
    T = -(-B * L // t)
    first = t_index * T
    expert = _share(chosen, experts, first, T, t).reshape(-1)
    one_hot = expert[:, None] == jnp.arange(experts + 1)  # [N, E + 1]: padding rows in the last column
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0, dtype=jnp.int32), expert[:, None], axis=1)[:, 0] - 1
    count = jnp.sum(one_hot, axis=0, dtype=jnp.int32)
    position = (jnp.cumsum(count) - count)[expert] + rank
    sizes = jnp.sum(count[:experts].reshape(d, experts // d), axis=1)
    return Dispatch(first, T, t, top_k, expert, count, position, sizes)


def received_blocks(sent, rows: int, block: int):
    """How the d N rows received here (slot s: device s's N rows, `sent` [d, here] of them for each of
    this device's `here` experts in turn) are listed for grouped_swiglu: (listed [n, block], indices
    into the d N rows, each expert's rows in blocks of `block`, padded to whole blocks (padding: d N);
    ends [here], each expert's last block + 1; expected, an expert's blocks at a balanced load with half a
    block of padding, for the roofline). n is enough blocks for any load."""
    d, here = sent.shape
    i, ends_in_slot = jnp.arange(rows), jnp.cumsum(sent, axis=1)
    local = jnp.minimum(jnp.sum(i[:, None] >= ends_in_slot[:, None], axis=2), here - 1)  # [d, N]: each row's expert
    # A row's place among its expert's rows: those from the devices before its sender's, then its own.
    place = (jnp.cumsum(sent, axis=0) - ends_in_slot)[jnp.arange(d)[:, None], local] + i
    blocks = -(-jnp.sum(sent, axis=0) // block)
    ends = jnp.cumsum(blocks)
    n = (d * rows + here * (block - 1)) // block
    slot = jnp.where(i < jnp.sum(sent, axis=1)[:, None], (ends - blocks)[local] * block + place, n * block)  # [d, N]
    listed = jnp.full(n * block, d * rows, jnp.int32).at[slot.reshape(-1)].set(jnp.arange(d * rows), mode="drop")
    expected = -(-(rows // max(here, 1) + block // 2) // block)
    return listed.reshape(n, block), ends, expected
