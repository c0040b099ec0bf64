"""The shuffling loader: determinism, coverage of an epoch, instant jumps, multi-process assembly."""

import math
import threading
import time

import jax
import numpy as np
import pytest
import zarr

from fixtures import run_processes
from seqax.config import DatasetConfig, DatasetError
from seqax.data.data_loader import RowOrder, derive_key, feistel_permute, make_loader
from seqax.data.flat_tokens import open_flat_tokens, write_flat_tokens

B, L = 8, 16
GOLDEN = 0x9E3779B97F4A7C15

# ---------------------------------------------------------------------------------------------
# An independent, pure-Python statement of the permutation and of the epoch order of
# docs/data-loader.md, built the slow way: materialize the block sequence, cut it into streams,
# shuffle each window, then deal rows round-robin.


def ref_mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def ref_key(*words: int) -> int:
    key = ref_mix(words[0])
    for w in words[1:]:
        key = ref_mix(key ^ w)
    return key


def ref_permute(x: int, n: int, key: int) -> int:
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    while True:
        left, right = x >> half, x & mask
        for r in range(6):
            round_key = ref_mix(key ^ (GOLDEN * (r + 1)) % 2**64)
            left, right = right, left ^ (ref_mix(right ^ round_key) & mask)
        x = (left << half) | right
        if x < n:
            return x


def ref_epoch_order(U: int, K: int, W: int, S: int, seed: int, epoch: int) -> list[int]:
    n_blocks = math.ceil(U / K)
    sequence = []
    for slot in range(n_blocks):
        block = ref_permute(slot, n_blocks, ref_key(seed, 1, epoch))
        sequence += list(range(block * K, min((block + 1) * K, U)))
    streams, start = [], 0
    for i in range(S):
        stream = sequence[start : start + U // S + (i < U % S)]
        start += len(stream)
        shuffled = []
        for w in range(math.ceil(len(stream) / W)):
            window = stream[w * W : (w + 1) * W]
            shuffled += [window[ref_permute(t, len(window), ref_key(seed, 2, epoch, i, w))] for t in range(len(window))]
        streams.append(shuffled)
    return [streams[p % S][p // S] for p in range(U)]


# ---------------------------------------------------------------------------------------------


def test_permutation_pinned():
    """A stored output: any change to the generator (or to numpy's integer arithmetic) fails here."""
    assert feistel_permute(np.arange(12), 12, derive_key(42)).tolist() == [6, 1, 5, 4, 2, 10, 8, 7, 3, 11, 0, 9]
    order = RowOrder(rows=50, block=4, window=16, streams=2, seed=7)
    assert order.rows_of(np.arange(0, 100, 7)).tolist() == [4, 41, 47, 33, 46, 35, 1, 17, 46, 30, 8, 48, 0, 39, 26]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4097])
def test_permutation_matches_reference_and_inverts(n):
    key = derive_key(n, 5)
    perm = feistel_permute(np.arange(n), n, key)
    assert sorted(perm.tolist()) == list(range(n))
    assert perm.tolist() == [ref_permute(x, n, int(key)) for x in range(n)]
    assert feistel_permute(perm, n, key, inverse=True).tolist() == list(range(n))


@pytest.mark.parametrize("U,K,W,S", [(50, 4, 16, 2), (37, 5, 8, 3), (64, 8, 64, 1), (10, 16, 16, 1), (23, 1, 1, 4)])
def test_row_order_matches_reference(U, K, W, S):
    order = RowOrder(rows=U, block=K, window=W, streams=S, seed=11)
    for epoch in (0, 3):
        assert order.rows_of(np.arange(epoch * U, (epoch + 1) * U)).tolist() == ref_epoch_order(U, K, W, S, 11, epoch)


# ---------------------------------------------------------------------------------------------
# A dataset whose train token at position k has id k + 1: a target says exactly where it came from.


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=150)
    ends = np.cumsum(lengths)
    train = [np.arange(e - n, e, dtype=np.uint32) + 1 for n, e in zip(lengths, ends)]
    assert ends[-1] % L != 0  # the last packed row is partial
    path = str(tmp_path_factory.mktemp("data") / "unique.zarr")
    write_flat_tokens(path, {"train": train, "validation": train[:4]}, {"tokenizer": {"kind": "test"}},
                      chunk_tokens=256)
    return open_flat_tokens(path)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 1, 2), ("d", "c", "t"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


def loader_for(dataset, mesh, packed=True, seed=0, streams=1, prefetch=0, batch=B, length=L):
    h = DatasetConfig(path=dataset.path, packed=packed, seed=seed, streams=streams, read_block_tokens=4 * length,
                      shuffle_buffer_tokens=32 * length, prefetch=prefetch)
    return make_loader(h, dataset, "train", batch, length, mesh)


def host(batch):
    return tuple(np.asarray(a) for a in (batch.targets, batch.is_seq_start, batch.loss_mask))


@pytest.mark.parametrize("streams", [1, 2])
def test_batch_is_a_function_of_the_step(dataset, mesh, streams):
    step = 23  # past the first epoch (about 19 steps)
    fresh = loader_for(dataset, mesh, streams=streams)
    expected = host(fresh.batch(step))
    fresh.close()
    for prefetch in (0, 1, 2):
        sequential = loader_for(dataset, mesh, streams=streams, prefetch=prefetch)
        for s in range(step):
            sequential.batch(s)
        got = host(sequential.batch(step))
        sequential.close()
        for a, b in zip(expected, got):
            np.testing.assert_array_equal(a, b)
    restarted = loader_for(dataset, mesh, streams=streams, prefetch=2)  # as after a restart: a new loader, then a jump
    for a, b in zip(expected, host(restarted.batch(step))):
        np.testing.assert_array_equal(a, b)
    restarted.close()
    other_seed = loader_for(dataset, mesh, streams=streams, seed=1)
    assert not np.array_equal(host(other_seed.batch(step))[0], expected[0])
    other_seed.close()


def rows_of_epoch(loader, epoch):
    """Host (targets, is_seq_start, loss_mask) of every global row of `epoch`, in order."""
    U, first = loader.order.rows, epoch * loader.order.rows
    steps = range(first // B, (first + U - 1) // B + 1)
    parts = [loader.host_rows(s, (0, B)) for s in steps]
    skip = first - steps[0] * B
    return tuple(np.concatenate([p[k] for p in parts])[skip : skip + U] for k in range(3))


@pytest.mark.parametrize("streams", [1, 3])
def test_packed_epoch_uses_every_token_once(dataset, mesh, streams):
    n = dataset.splits["train"].num_tokens
    loader = loader_for(dataset, mesh, streams=streams)
    assert loader.order.rows == math.ceil(n / L)
    for epoch in (0, 1):
        targets, starts, mask = rows_of_epoch(loader, epoch)
        assert sorted(targets[mask].tolist()) == list(range(1, n + 1))
        # Padding: only the tail of the one partial row, and it is an empty document.
        assert (~mask).sum() == loader.order.rows * L - n
        assert np.all(targets[~mask] == 0) and np.all(starts[~mask])
        # Document starts are where the file says.
        file_starts = set(dataset.splits["train"].seq_starts[:-1].astype(int) + 1)
        assert set(targets[mask & starts].tolist()) == file_starts
    first_rows = [rows_of_epoch(loader, e)[0][:, 0].tolist() for e in (0, 1)]
    assert first_rows[0] != first_rows[1]  # each epoch has its own order
    assert [loader.epoch(s) for s in (0, 18, 19, 20, 40)] == [s * B // loader.order.rows for s in (0, 18, 19, 20, 40)]
    loader.close()


def test_no_batch_is_in_file_order(dataset, mesh):
    loader = loader_for(dataset, mesh)
    steps = loader.order.rows // B
    for s in range(steps):
        row_index = (loader.host_rows(s, (0, B))[0][:, 0].astype(np.int64) - 1) // L
        assert not np.all(np.diff(row_index) == 1), f"batch {s} is rows {row_index.tolist()} in file order"
    loader.close()


def test_unpacked_rows_are_documents(dataset, mesh):
    starts = dataset.splits["train"].seq_starts[:].astype(int)
    loader = loader_for(dataset, mesh, packed=False)
    assert loader.order.rows == len(starts) - 1
    targets, is_start, mask = rows_of_epoch(loader, 0)
    first_tokens = targets[:, 0].tolist()
    assert sorted(first_tokens) == (starts[:-1] + 1).tolist()  # every document once
    for row, first in zip(range(len(targets)), first_tokens):
        doc = starts.tolist().index(first - 1)
        n = min(starts[doc + 1] - starts[doc], L)
        np.testing.assert_array_equal(targets[row, :n], np.arange(first, first + n))
        assert mask[row].tolist() == [True] * n + [False] * (L - n)
        assert is_start[row].tolist() == [True] + [False] * (n - 1) + [True] * (L - n)
        assert np.all(targets[row, n:] == 0)
    loader.close()


def test_jump_to_step_one_million(tmp_path, mesh):
    n = 1_000_000
    path = str(tmp_path / "million.zarr")
    write_flat_tokens(path, {"train": [np.arange(1, n + 1, dtype=np.uint32)], "validation": [np.ones(5, np.uint32)]},
                      {}, chunk_tokens=1 << 16)
    dataset = open_flat_tokens(path)
    h = DatasetConfig(path=path, packed=True, seed=0, streams=2, read_block_tokens=1 << 16,
                      shuffle_buffer_tokens=1 << 20, prefetch=0)
    loader = make_loader(h, dataset, "train", 8, 128, mesh)
    start = time.perf_counter()
    targets = np.asarray(loader.batch(1_000_000).targets)
    seconds = time.perf_counter() - start
    assert seconds < 1.0, f"batch(1_000_000) took {seconds:.3f} s"
    # Each row is 128 consecutive tokens of the file, starting on a row boundary.
    assert np.all(np.diff(targets, axis=1) == 1) and np.all((targets[:, 0] - 1) % 128 == 0)
    assert loader.epoch(1_000_000) == 1_000_000 * 8 // math.ceil(n / 128)
    loader.close()


def test_prefetch_thread_stops_on_close(dataset, mesh):
    loader = loader_for(dataset, mesh, prefetch=2)
    loader.batch(0)
    assert any(t.name.startswith("seqax-prefetch") for t in threading.enumerate())
    loader.close()
    assert not any(t.name.startswith(("seqax-prefetch", "seqax-read")) for t in threading.enumerate())


@pytest.mark.slow
def test_two_processes_assemble_the_same_batch(dataset, mesh, tmp_path):
    steps = [0, 5, 40]
    run_processes("loader_process.py", 2, dataset.path, str(tmp_path), *map(str, steps))
    h = DatasetConfig(path=dataset.path, packed=True, seed=3, streams=2, read_block_tokens=64,
                      shuffle_buffer_tokens=1024, prefetch=1)
    single = make_loader(h, dataset, "train", 8, 16, mesh)  # the same settings as loader_process.py, in one process
    gathered = np.load(tmp_path / "batches.npz")
    for step in steps:
        for name, value in zip(("targets", "is_seq_start", "loss_mask"), host(single.batch(step))):
            np.testing.assert_array_equal(gathered[f"{name}_{step}"], value)
    single.close()
    rows = [set(map(tuple, np.load(tmp_path / f"rows_{i}.npy").tolist())) for i in range(2)]
    # each reads only its rows
    assert rows[0].isdisjoint(rows[1]) and sorted(rows[0] | rows[1]) == [(i, i + 2) for i in range(0, 8, 2)]


# ---------------------------------------------------------------------------------------------
# Malformed datasets.


def damaged_copy(dataset, tmp_path, damage):
    path = str(tmp_path / "damaged.zarr")
    group = zarr.open_group(path, mode="w")
    group.attrs.update(dataset.attrs)
    for name, split in dataset.splits.items():
        sub = group.create_group(name)
        for array in ("encoded_tokens", "seq_starts"):
            data = getattr(split, array)[:]
            sub.create_array(array, shape=data.shape, dtype=data.dtype)[:] = data
    damage(group)
    return path


def replace(group, name, data):
    del group[name]
    group.create_array(name, shape=data.shape, dtype=data.dtype)[:] = data


@pytest.mark.parametrize("damage,message", [
    (lambda g: replace(g, "train/encoded_tokens", g["train/encoded_tokens"][:].astype(np.int64)),
     "must be 1-D uint32"),
    (lambda g: replace(g, "train/seq_starts",
                       g["train/seq_starts"][:][[0, 2, 1] + list(range(3, g["train/seq_starts"].shape[0]))]),
     "not strictly increasing"),
    (lambda g: g.__delitem__("validation"), "has no 'validation' split"),
    (lambda g: g.attrs.update({"format": "something-else"}), "expected 'flat-tokens/1'"),
])
def test_malformed_dataset_is_rejected(dataset, tmp_path, damage, message):
    with pytest.raises(DatasetError, match=message):
        open_flat_tokens(damaged_copy(dataset, tmp_path, damage))


def test_token_above_max_token_id_is_rejected(dataset, mesh, tmp_path):
    path = damaged_copy(dataset, tmp_path, lambda g: g.attrs.update({"max_token_id": 100}))
    loader = loader_for(open_flat_tokens(path), mesh)
    with pytest.raises(DatasetError, match="above its attribute max_token_id=100"):
        for s in range(loader.order.rows // B + 1):
            loader.batch(s)
    loader.close()


def test_unpacked_rejects_seq_starts_that_disagree_with_start_bits(dataset, mesh, tmp_path):
    def shift_a_start(g):
        starts = g["train/seq_starts"][:]
        starts[1] += 1  # still increasing, but no longer at a start bit
        replace(g, "train/seq_starts", starts)

    loader = loader_for(open_flat_tokens(damaged_copy(dataset, tmp_path, shift_a_start)), mesh, packed=False)
    with pytest.raises(DatasetError, match="lacks its start bit"):
        rows_of_epoch(loader, 0)
    loader.close()


def test_bad_loader_settings_are_rejected(dataset, mesh):
    with pytest.raises(DatasetError, match="dataset.streams=0 must be at least 1"):
        loader_for(dataset, mesh, streams=0)
    with pytest.raises(DatasetError, match="fewer than dataset.streams"):
        loader_for(dataset, mesh, streams=10_000)
