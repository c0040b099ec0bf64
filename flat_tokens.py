"""The flat-tokens dataset format (docs/flat-tokens.md): open, validate, write.

A zarr v3 group with one subgroup per split (`train`, `validation`). Each split holds
  encoded_tokens  uint32[N]   token_id * 2 + is_start (1 on the first token of a document)
  seq_starts      uint64[D+1] offset of each document in encoded_tokens, then N
and the group's attributes hold `max_token_id` (the largest token id in any split) and
`format` = "flat-tokens/1". A dataset is written to a temporary name and renamed into place,
so a path that exists is complete; FlatTokensWriter streams documents of any total size.
"""

import dataclasses
import os
import shutil
import uuid

import numpy as np
import zarr

from config import DatasetError

FORMAT = "flat-tokens/1"
SPLITS = ("train", "validation")
CHUNK_TOKENS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Split:
    encoded_tokens: zarr.Array  # uint32[N]
    seq_starts: zarr.Array  # uint64[D+1]

    @property
    def num_tokens(self) -> int:
        return self.encoded_tokens.shape[0]


@dataclasses.dataclass(frozen=True)
class FlatTokens:
    path: str
    max_token_id: int
    attrs: dict
    splits: dict[str, Split]


def open_flat_tokens(path: str, check_seq_starts: bool = True) -> FlatTokens:
    """Opens and validates a flat-tokens dataset; every problem is a one-line DatasetError."""
    if not os.path.isdir(path):
        raise DatasetError(f"dataset {path!r} does not exist; write one with tools/write_synthetic_dataset.py or tools/prepare_dataset.py")
    try:
        group = zarr.open_group(path, mode="r")
    except Exception as e:  # zarr raises several types for a non-group path
        raise DatasetError(f"dataset {path!r} is not a zarr group: {e}") from None
    attrs = dict(group.attrs)
    if attrs.get("format") != FORMAT:
        raise DatasetError(f"dataset {path!r} has format {attrs.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(attrs.get("max_token_id"), int):
        raise DatasetError(f"dataset {path!r} lacks the integer attribute max_token_id")
    splits = {}
    for name in SPLITS:
        if name not in group:
            raise DatasetError(f"dataset {path!r} has no {name!r} split")
        sub = group[name]
        for array, dtype in (("encoded_tokens", np.uint32), ("seq_starts", np.uint64)):
            if array not in sub:
                raise DatasetError(f"dataset {path!r}: split {name!r} has no array {array!r}")
            if sub[array].dtype != dtype or sub[array].ndim != 1:
                raise DatasetError(f"dataset {path!r}: {name}/{array} must be 1-D {np.dtype(dtype)}, got {sub[array].ndim}-D {sub[array].dtype}")
        split = Split(sub["encoded_tokens"], sub["seq_starts"])
        if check_seq_starts:
            _check_seq_starts(path, name, split)
        splits[name] = split
    return FlatTokens(path, attrs["max_token_id"], attrs, splits)


def _check_seq_starts(path: str, name: str, split: Split):
    starts = split.seq_starts[:]
    n = split.num_tokens
    if len(starts) < 2 or starts[0] != 0 or starts[-1] != n:
        raise DatasetError(f"dataset {path!r}: {name}/seq_starts must run from 0 to {n} (the token count)")
    if np.any(np.diff(starts.astype(np.int64)) <= 0):
        raise DatasetError(f"dataset {path!r}: {name}/seq_starts is not strictly increasing")


def encode_documents(documents: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(encoded_tokens, seq_starts) for a list of 1-D token arrays."""
    lengths = np.array([len(d) for d in documents], dtype=np.uint64)
    if np.any(lengths == 0):
        raise DatasetError("a document has no tokens")
    tokens = np.concatenate(documents).astype(np.uint64)
    if tokens.size and tokens.max() >= 2**31:
        raise DatasetError(f"token id {int(tokens.max())} does not fit flat-tokens (ids must be below 2^31)")
    seq_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
    encoded = (tokens * 2).astype(np.uint32)
    encoded[seq_starts[:-1].astype(np.int64)] += 1
    return encoded, seq_starts


class _Appender:
    """A 1-D zarr array grown at its end; whole write units (a shard, or a chunk when unsharded)
    are written at once, so no stored chunk is ever rewritten."""

    def __init__(self, group: zarr.Group, name: str, dtype, chunk: int, shard: int | None, compression_level: int):
        self.array = group.create_array(name, shape=(0,), dtype=dtype, chunks=(chunk,), shards=(shard,) if shard else None,
                                        compressors=zarr.codecs.ZstdCodec(level=compression_level))
        self.unit = shard or chunk
        self.pending: list[np.ndarray] = []
        self.pending_size = self.written = 0

    def append(self, values: np.ndarray):
        self.pending.append(values)
        self.pending_size += len(values)
        if self.pending_size >= self.unit:
            self._write(final=False)

    def _write(self, final: bool):
        data = np.concatenate(self.pending) if self.pending else np.zeros(0, self.array.dtype)
        keep = len(data) if final else len(data) // self.unit * self.unit
        if keep:
            self.array.resize((self.written + keep,))
            self.array[self.written : self.written + keep] = data[:keep]
            self.written += keep
        self.pending, self.pending_size = [data[keep:]], len(data) - keep

    def finish(self):
        self._write(final=True)


class FlatTokensWriter:
    """Streams documents into a new flat-tokens dataset, in memory one write unit per array.

    Everything goes to `<path>.tmp-<random>`; `commit()` writes the attributes (`format` last of
    all) and renames the directory into place, so `path` either does not exist or is complete,
    and an interrupted temporary directory is not a valid dataset. Used as a context manager, an
    exception removes the temporary directory.
    """

    def __init__(self, path: str, overwrite: bool = False, chunk_tokens: int = CHUNK_TOKENS, shard_tokens: int | None = None, compression_level: int = 3):
        if os.path.exists(path) and not overwrite:
            raise DatasetError(f"{path!r} exists; pass --overwrite to replace it")
        if chunk_tokens < 1 or (shard_tokens and shard_tokens % chunk_tokens):
            raise DatasetError(f"chunk_tokens={chunk_tokens} must be positive and divide shard_tokens={shard_tokens}")
        self.path, self.tmp = path, f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        self.group = zarr.open_group(self.tmp, mode="w")
        self.max_token_id = 0
        self.tokens = {}
        self.starts = {}
        for name in SPLITS:
            sub = self.group.create_group(name)
            self.tokens[name] = _Appender(sub, "encoded_tokens", np.uint32, chunk_tokens, shard_tokens, compression_level)
            self.starts[name] = _Appender(sub, "seq_starts", np.uint64, chunk_tokens, shard_tokens, compression_level)
            self.starts[name].append(np.zeros(1, np.uint64))
        self.num_tokens = dict.fromkeys(SPLITS, 0)
        self.num_documents = dict.fromkeys(SPLITS, 0)

    def add_encoded(self, split: str, encoded: np.ndarray, lengths: np.ndarray):
        """Appends documents already encoded (see encode_documents) with their token counts."""
        if len(encoded):
            self.max_token_id = max(self.max_token_id, int(encoded.max()) >> 1)
        self.tokens[split].append(encoded.astype(np.uint32, copy=False))
        self.starts[split].append(self.num_tokens[split] + np.cumsum(lengths, dtype=np.uint64))
        self.num_tokens[split] += int(np.sum(lengths, dtype=np.uint64))
        self.num_documents[split] += len(lengths)

    def add_documents(self, split: str, documents: list[np.ndarray]):
        if documents:
            encoded, seq_starts = encode_documents(documents)
            self.add_encoded(split, encoded, np.diff(seq_starts))

    def add_bytes(self, name: str, data: bytes):
        """Stores a blob (for example the tokenizer's JSON) as a uint8 array at the group's root."""
        out = self.group.create_array(name, shape=(len(data),), dtype=np.uint8, chunks=(max(1, len(data)),), compressors=zarr.codecs.ZstdCodec(level=3))
        out[:] = np.frombuffer(data, np.uint8)

    def commit(self, attrs: dict):
        for name in SPLITS:
            if self.num_documents[name] == 0:
                raise DatasetError(f"split {name!r} of {self.path!r} would have no documents")
            self.tokens[name].finish()
            self.starts[name].finish()
        self.group.attrs.update({**attrs, "max_token_id": self.max_token_id})
        self.group.attrs["format"] = FORMAT
        old = f"{self.path}.old-{uuid.uuid4().hex[:8]}"
        if os.path.exists(self.path):
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is not None:
            self.abort()


def write_flat_tokens(path: str, splits: dict[str, list[np.ndarray]], attrs: dict, overwrite: bool = False, **storage):
    """Writes lists of documents per split; the dataset appears at `path` only once complete.
    `storage`: chunk_tokens, shard_tokens, compression_level (see FlatTokensWriter)."""
    with FlatTokensWriter(path, overwrite=overwrite, **storage) as writer:
        for name in SPLITS:
            writer.add_documents(name, splits[name])
        writer.commit(attrs)
