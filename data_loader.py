"""Batches for training: `loader.batch(step)` is a pure function of the dataset, the loader
settings and `step`, assembled as global arrays sharded over the mesh.

This loader packs the train split in file order: batch s holds the B*L tokens that start at
(s mod n_batches) * B*L. Each process reads only the rows its own devices hold.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flat_tokens import DatasetError, FlatTokens


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """The `dataset:` section of the training config."""

    path: str  # a flat-tokens zarr (docs/flat-tokens.md)


@dataclasses.dataclass(frozen=True)
class Batch:
    targets: jax.Array  # u32[B L]: the tokens to predict
    is_seq_start: jax.Array  # bool[B L]: True on the first token of a document


class PackedLoader:
    def __init__(self, dataset: FlatTokens, split: str, batch: int, length: int, mesh: jax.sharding.Mesh):
        self.tokens = dataset.splits[split].encoded_tokens
        self.batch_size, self.length = batch, length
        self.n_batches = self.tokens.shape[0] // (batch * length)
        if self.n_batches == 0:
            raise DatasetError(f"split {split!r} of {dataset.path!r} has {self.tokens.shape[0]} tokens, fewer than one batch of {batch}x{length}")
        self.sharding = NamedSharding(mesh, PartitionSpec("d", None))

    def read_rows(self, step: int, rows: slice) -> np.ndarray:
        """Encoded tokens of rows [rows.start, rows.stop) of the batch at `step`."""
        start = (step % self.n_batches) * self.batch_size * self.length
        first, last = rows.start or 0, self.batch_size if rows.stop is None else rows.stop
        flat = self.tokens[start + first * self.length : start + last * self.length]
        return flat.reshape(last - first, self.length)

    def batch(self, step: int) -> Batch:
        shape = (self.batch_size, self.length)
        cache: dict = {}

        def rows_of(index):  # reads each row block once, though several devices may share it
            key = (index[0].start, index[0].stop)
            if key not in cache:
                cache[key] = self.read_rows(step, index[0])
            return cache[key]

        targets = jax.make_array_from_callback(shape, self.sharding, lambda i: rows_of(i) >> 1)
        starts = jax.make_array_from_callback(shape, self.sharding, lambda i: (rows_of(i) & 1).astype(bool))
        return Batch(targets, starts)


def make_loader(h: DatasetConfig, dataset: FlatTokens, split: str, batch: int, length: int, mesh: jax.sharding.Mesh) -> PackedLoader:
    return PackedLoader(dataset, split, batch, length, mesh)
