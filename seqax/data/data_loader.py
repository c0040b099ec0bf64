"""Batches for training: `loader.batch(step)` is a pure function of the dataset, the loader
settings (the `dataset:` config section) and `step`, assembled as global arrays sharded
`P('d', 'c')` over the mesh (rows over d; with context parallelism, mesh.c > 1, each row's
positions over c in the balanced order of `zigzag_chunks`). Nothing is saved with a checkpoint:
resuming at step s, or jumping to it, costs one batch. docs/data-loader.md explains the scheme; in short:

Rows. A split is cut into U rows of length L. Packed (`packed: true`): row u holds tokens
[u*L, (u+1)*L) of the split, so documents continue across rows and every token is in exactly one
row; the last row is padded when L does not divide the token count. Unpacked: row u holds the
first L tokens of document u, padded. Padding: target 0, is_seq_start True (every pad position is
an empty document that attends only to itself), loss_mask False.

Order. Global row g = step*B + b (b the row within the batch) is row `order(g mod U)` of epoch
e = g // U: every epoch uses every row once, and a batch may hold the end of one epoch and the
start of the next. Within epoch e:
  1. read blocks: rows are grouped into blocks of K consecutive rows (one contiguous read each),
     and the blocks are put in the order of a keyed permutation (key: seed, e);
  2. streams: that sequence of U rows is cut into S contiguous streams (sizes differ by at most
     one); global rows go round-robin over the streams, so a batch draws from S distant places;
  3. shuffle buffer: each stream is cut into windows of W rows, and the rows of a window are put
     in the order of a keyed permutation (key: seed, e, stream, window). A window spans about W/K
     blocks, which is all a stream needs in memory at a time (the block cache).
The permutations are `feistel_permute`: integer arithmetic in numpy, version-stable, O(1) per
row. So a batch costs O(B) arithmetic plus reading its rows' blocks, whatever the step.

Per process: only the rows held by this process's devices are computed and read; the blocks are
cached (least recently used) and a background thread prepares the next `prefetch` batches.
"""

import collections
import concurrent.futures
import dataclasses
import math
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from seqax.config import DatasetConfig, DatasetError
from seqax.data.flat_tokens import FlatTokens


@dataclasses.dataclass(frozen=True)
class Batch:
    targets: jax.Array  # u32[B L]: the tokens to predict (0 on padding)
    is_seq_start: jax.Array  # bool[B L]: True on the first token of a document (and on padding)
    loss_mask: jax.Array  # bool[B L]: False on padding, which no loss should count


def host_batch_to_devices(targets: np.ndarray, is_seq_start: np.ndarray, loss_mask: np.ndarray,
                          mesh: jax.sharding.Mesh) -> Batch:
    """A batch that every process holds whole, on the mesh's devices as the loader lays its batches
    out: rows over d, each row's positions over c in the order of zigzag_chunks."""
    layout = zigzag_order(targets.shape[1], mesh.shape["c"])
    sharding = NamedSharding(mesh, PartitionSpec("d", "c"))
    return Batch(*(jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[:, layout][index])
                   for x in (targets, is_seq_start, loss_mask)))


# ---------------------------------------------------------------------------------------------
# The permutation. A balanced Feistel network (Luby & Rackoff 1988) on 2h-bit integers, with
# 2h the smallest even width >= 2 holding n-1, restricted to [0, n) by cycle walking (Black &
# Rogaway 2002): apply the network again until the value is below n. The domain is < 4n, so a
# value walks fewer than 4 times on average. Round function: the splitmix64 finalizer (Steele,
# Lea & Flood 2014) of (right half xor round key). Only uint64 xor, shift, and, and wrapping
# multiply are used, so the result is the same on every numpy version and machine.

ROUNDS = 6
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, splitmix64's increment


def mix64(x):
    """splitmix64's finalizer: a bijection on uint64 that mixes every bit into every bit."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):  # multiplication modulo 2^64 is the intent
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def derive_key(*words) -> np.ndarray:
    """A uint64 key from integers (or equal-shape arrays of them), in order: mix(...mix(mix(w0) ^ w1)...)."""
    key = mix64(words[0])
    for w in words[1:]:
        key = mix64(key ^ np.asarray(w, dtype=np.uint64))
    return key


def _feistel(x, key, half_bits, inverse: bool):
    mask = (np.uint64(1) << half_bits) - np.uint64(1)
    left, right = x >> half_bits, x & mask
    rounds = range(ROUNDS - 1, -1, -1) if inverse else range(ROUNDS)
    for r in rounds:
        round_key = mix64(key ^ np.uint64((GOLDEN * (r + 1)) % 2**64))
        if inverse:  # undo (L, R) -> (R, L ^ F(R))
            left, right = right ^ (mix64(left ^ round_key) & mask), left
        else:
            left, right = right, left ^ (mix64(right ^ round_key) & mask)
    return (left << half_bits) | right


def feistel_permute(x, n, key, inverse: bool = False) -> np.ndarray:
    """The image of x under the keyed permutation of [0, n) (or its inverse). x, n and key are
    integers or arrays that broadcast together; every x must be in [0, n). Returns int64."""
    x, n, key = (a.astype(np.uint64)
                 for a in np.broadcast_arrays(np.asarray(x), np.asarray(n), np.asarray(key, dtype=np.uint64)))
    if np.any(x >= n):
        raise ValueError("feistel_permute: every x must be below its n")
    half_bits = np.array([max(1, (int(v - 1).bit_length() + 1) // 2) for v in n.ravel()],
                         dtype=np.uint64).reshape(n.shape)
    y = _feistel(x, key, half_bits, inverse)
    walking = y >= n
    while np.any(walking):
        y[walking] = _feistel(y[walking], key[walking], half_bits[walking], inverse)
        walking = y >= n
    return y.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# The order of rows: global row index -> row of the split.

BLOCK_ORDER, WINDOW_ORDER = 1, 2  # purposes mixed into the keys


@dataclasses.dataclass(frozen=True)
class RowOrder:
    rows: int  # U
    block: int  # K
    window: int  # W
    streams: int  # S
    seed: int

    def rows_of(self, g: np.ndarray) -> np.ndarray:
        """The split's row index for each global row index g (int64 array)."""
        U, K, W, S = self.rows, self.block, self.window, self.streams
        g = np.asarray(g, dtype=np.int64)
        epoch, p = g // U, g % U
        # Streams: p goes round-robin; stream i owns positions [offset_i, offset_i + size_i).
        stream, j = p % S, p // S
        size = U // S + (stream < U % S)
        offset = stream * (U // S) + np.minimum(stream, U % S)
        # Shuffle buffer: window w of the stream, permuted within.
        window, t = j // W, j % W
        length = np.minimum(W, size - window * W)
        q = offset + window * W + feistel_permute(t, length, derive_key(self.seed, WINDOW_ORDER, epoch, stream, window))
        # Read blocks: q is a position in the sequence of blocks in permuted order, where the one
        # short block (the last, when K does not divide U) sits at slot `short_slot`.
        n_blocks, short = -(-U // K), U - (-(-U // K) - 1) * K
        block_key = derive_key(self.seed, BLOCK_ORDER, epoch)
        short_slot = feistel_permute(n_blocks - 1, n_blocks, block_key, inverse=True)
        shifted = np.where(q >= short_slot * K + short, q + (K - short), q)  # slots after the short one
        slot = np.where((q >= short_slot * K) & (q < short_slot * K + short), short_slot, shifted // K)
        within = np.where(slot == short_slot, q - short_slot * K, shifted % K)
        return feistel_permute(slot, n_blocks, block_key) * K + within


# ---------------------------------------------------------------------------------------------
# Reading rows: blocks of K rows, each one contiguous read, cached.


class RowSource:
    """Rows of one split, read K at a time. A block is (encoded u32[k L], valid lengths i64[k])."""

    def __init__(self, dataset: FlatTokens, split: str, length: int, packed: bool):
        if split not in dataset.splits:
            raise DatasetError(f"dataset {dataset.path!r} has no split {split!r} (it has {', '.join(dataset.splits)})")
        self.where = f"{dataset.path!r} split {split!r}"
        self.split, self.length, self.packed, self.max_token_id = (
            dataset.splits[split], length, packed, dataset.max_token_id)
        n_tokens = self.split.num_tokens
        self.rows = -(-n_tokens // length) if packed else self.split.seq_starts.shape[0] - 1

    def read_block(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        L = self.length
        if self.packed:
            begin, end = first * L, min((first + count) * L, self.split.num_tokens)
            tokens = np.zeros(count * L, np.uint32)
            tokens[: end - begin] = self.split.read("encoded_tokens", begin, end)
            valid = np.clip(end - begin - np.arange(count) * L, 0, L)
            return tokens.reshape(count, L), valid
        starts = self.split.read("seq_starts", first, first + count + 1).astype(np.int64)
        flat = self.split.read("encoded_tokens", int(starts[0]), int(starts[-1]))
        valid = np.minimum(np.diff(starts), L)
        offsets = starts[:-1] - starts[0]
        if np.any((flat[offsets] & 1) == 0):
            raise DatasetError(f"dataset {self.where}: document {first} or one of the next {count - 1} "
                               "lacks its start bit: seq_starts is wrong")
        columns = np.arange(L)
        gather = np.minimum(offsets[:, None] + columns, max(len(flat) - 1, 0))
        return np.where(columns < valid[:, None], flat[gather], 0).astype(np.uint32), valid


class BlockCache:
    """Least-recently-used blocks of a RowSource; missing blocks of one request are read in parallel."""

    def __init__(self, source: RowSource, block: int, capacity: int, readers: int = 4):
        self.source, self.block, self.capacity = source, block, capacity
        self.blocks: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self.pool = concurrent.futures.ThreadPoolExecutor(readers, thread_name_prefix="seqax-read")
        self.lock = threading.Lock()

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(encoded u32[len(rows) L], valid lengths) of the given split rows."""
        ids = rows // self.block
        with self.lock:
            missing = [int(b) for b in np.unique(ids) if int(b) not in self.blocks]
            count = lambda b: min(self.block, self.source.rows - b * self.block)  # noqa: E731
            for b, data in zip(missing,
                               self.pool.map(lambda b: self.source.read_block(b * self.block, count(b)), missing)):
                self.blocks[b] = data
            parts = []
            for b in ids:
                self.blocks.move_to_end(int(b))
                parts.append(self.blocks[int(b)])
            while len(self.blocks) > max(self.capacity, len(np.unique(ids))):
                self.blocks.popitem(last=False)
        within = rows % self.block
        return np.stack([p[0][w] for p, w in zip(parts, within)]), np.array([p[1][w] for p, w in zip(parts, within)])

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# The layout of a row over the c devices of context parallelism. Causal attention gives a
# query at position p p keys, so c equal contiguous pieces would give the last device about
# 2c - 1 times the work of the first. Instead the row is cut into 2c chunks and device r holds
# chunks r and 2c-1-r, one early and one late: every device then has the same number of
# (query chunk, key chunk) pairs to compute, 2c + 1, and at every ring step two pairs' worth
# (the layout of Megatron-LM's context parallelism and of Llama 3's, Dubey et al. 2024, 3.3.2).
# Chunks stay contiguous, so attention's blocks, document skipping and RoPE work unchanged.


def zigzag_chunks(length: int, c: int) -> list[tuple[int, int]]:
    """The chunks [start, stop) of a row's positions in the order the c devices hold them
    (device r: the r-th pair), adjacent chunks merged: c = 1 gives [(0, length)]."""
    bounds = [k * length // (2 * c) for k in range(2 * c + 1)]
    chunks: list[tuple[int, int]] = []
    for r in range(c):
        for k in (r, 2 * c - 1 - r):
            if chunks and chunks[-1][1] == bounds[k]:
                chunks[-1] = (chunks[-1][0], bounds[k + 1])
            else:
                chunks.append((bounds[k], bounds[k + 1]))
    return chunks


def zigzag_order(length: int, c: int) -> np.ndarray:
    """The row position held at each place of the laid-out row: [length] int."""
    return np.concatenate([np.arange(start, stop) for start, stop in zigzag_chunks(length, c)])


# ---------------------------------------------------------------------------------------------
# The loader.


class ShufflingLoader:
    def __init__(self, settings: DatasetConfig, dataset: FlatTokens, split: str, batch: int, length: int,
                 mesh: jax.sharding.Mesh):
        least = {"seed": 0, "streams": 1, "read_block_tokens": 1, "shuffle_buffer_tokens": 1, "prefetch": 0}
        for key, value in least.items():
            if getattr(settings, key) < value:
                raise DatasetError(f"dataset.{key}={getattr(settings, key)} must be at least {value}")
        self.source = RowSource(dataset, split, length, settings.packed)
        if self.source.rows < settings.streams:
            raise DatasetError(f"dataset {self.source.where} has {self.source.rows} rows of length {length}, "
                               f"fewer than dataset.streams={settings.streams}; lower it")
        block = max(1, settings.read_block_tokens // length)
        window = max(block, settings.shuffle_buffer_tokens // length)
        self.order = RowOrder(self.source.rows, block, window, settings.streams, settings.seed)
        self.cache = BlockCache(self.source, block, capacity=2 * settings.streams * (math.ceil(window / block) + 2))
        self.batch_size, self.length = batch, length
        self.shape = (batch, length)
        self.sharding = NamedSharding(mesh, PartitionSpec("d", "c"))
        self.layout = zigzag_order(length, mesh.shape["c"])
        self.local_rows = sorted({_row_range(index, batch)
                                  for index in self.sharding.addressable_devices_indices_map(self.shape).values()})
        self.prefetch = settings.prefetch
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.worker = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="seqax-prefetch")
                       if settings.prefetch else None)

    def epoch(self, step: int) -> int:
        """The epoch of the first row of the batch at `step`."""
        return step * self.batch_size // self.order.rows

    def host_rows(self, step: int, rows: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(targets u32, is_seq_start bool, loss_mask bool), each [stop-start L], of global batch rows
        [start, stop) at `step`."""
        start, stop = rows
        encoded, valid = self.cache.rows(self.order.rows_of(step * self.batch_size + np.arange(start, stop)))
        mask = np.arange(self.length) < valid[:, None]
        targets = np.where(mask, encoded >> 1, 0).astype(np.uint32)
        if targets.size and int(targets.max()) > self.source.max_token_id:
            raise DatasetError(f"dataset {self.source.where} holds token id {int(targets.max())} "
                               f"above its attribute max_token_id={self.source.max_token_id}")
        return targets, ~mask | ((encoded & 1) == 1), mask

    def local_batch(self, step: int) -> dict[tuple[int, int], tuple[np.ndarray, ...]]:
        return {rows: self.host_rows(step, rows) for rows in self.local_rows}

    def batch(self, step: int) -> Batch:
        data = self._prefetched(step)
        def piece(index, k):  # a device's rows, and of each its positions in the layout's order
            return data[_row_range(index, self.batch_size)][k][:, self.layout[index[1]]]

        arrays = [jax.make_array_from_callback(self.shape, self.sharding, lambda index, k=k: piece(index, k))
                  for k in range(3)]
        return Batch(*arrays)

    def _prefetched(self, step: int):
        if self.worker is None:
            return self.local_batch(step)
        future = self.pending.pop(step, None) or self.worker.submit(self.local_batch, step)
        for stale in [s for s in self.pending if not step < s <= step + self.prefetch]:
            self.pending.pop(stale).cancel()
        for ahead in range(step + 1, step + 1 + self.prefetch):
            if ahead not in self.pending:
                self.pending[ahead] = self.worker.submit(self.local_batch, ahead)
        return future.result()

    def close(self):
        """Stops the prefetch thread and the readers; batch() must not be called afterwards."""
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
            self.pending.clear()
        self.cache.close()


def _row_range(index: tuple, batch: int) -> tuple[int, int]:
    rows = index[0] if index else slice(None)
    return (rows.start or 0, batch if rows.stop is None else rows.stop)


def make_loader(settings: DatasetConfig, dataset: FlatTokens, split: str, batch: int, length: int,
                mesh: jax.sharding.Mesh) -> ShufflingLoader:
    return ShufflingLoader(settings, dataset, split, batch, length, mesh)

