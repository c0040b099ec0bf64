"""The flat-tokens dataset format (docs/flat-tokens.md): open, validate, write.

A zarr v3 group with one subgroup per split (`train`, `validation`). Each split holds
  encoded_tokens  uint32[N]   token_id * 2 + is_start (1 on the first token of a document)
  seq_starts      uint64[D+1] offset of each document in encoded_tokens, then N
and the group's attributes hold `max_token_id` (the largest token id in any split) and
`format` = "flat-tokens/1". A dataset is written to a temporary name and renamed into place,
so a path that exists is complete; FlatTokensWriter streams documents of any total size.
Every chunk carries its CRC32C and every token array records the size of each of its files
(`stored_bytes`): opening checks that each file is there and whole, each read checks its files
again and zarr the checksums, so a damaged dataset is one DatasetError, never zeros.
"""

import contextlib
import dataclasses
import errno
import os
import shutil
import uuid

import google_crc32c
import numpy as np
import zarr

from seqax.config import DatasetError
from seqax.console import warn

FORMAT = "flat-tokens/1"
SPLITS = ("train", "validation")
ARRAYS = ("encoded_tokens", "seq_starts")
STORED_BYTES = "stored_bytes"  # array attribute: the size of each of its files, recorded at commit
UNLISTED = 2**64 - 1  # a shard index's offset of a chunk that was never written
CHUNK_TOKENS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Split:
    encoded_tokens: zarr.Array  # uint32[N]
    seq_starts: zarr.Array  # uint64[D+1]
    directory: str  # <dataset>/<split>, for the files and the messages

    @property
    def num_tokens(self) -> int:
        return self.encoded_tokens.shape[0]

    def read(self, array: str, begin: int, end: int) -> np.ndarray:
        """Elements [begin, end) of `array`, each file they come from checked present and of its
        recorded size, each chunk checked against its CRC32C (by zarr, as it decodes)."""
        values = getattr(self, array)
        unit = file_unit(values)
        files = range(begin // unit, -(-end // unit))
        for i in files:
            self.check_file(array, i)
        try:
            return values[begin:end]
        except Exception:  # zarr raises ValueError on a checksum, others on a garbled chunk
            for i in files:  # find the damaged file to name it
                try:
                    values[i * unit : min((i + 1) * unit, values.shape[0])]
                except Exception as e:
                    raise DatasetError(f"dataset {self.file(array, i)!r} is damaged ({type(e).__name__}: {e}); "
                                       "write the dataset again") from None
            raise

    def file(self, array: str, i: int) -> str:
        """The file of chunk (or shard) i of `array`."""
        return os.path.join(self.directory, array, *getattr(self, array).metadata.encode_chunk_key((i,)).split("/"))

    def check_file(self, array: str, i: int):
        recorded = getattr(self, array).attrs.get(STORED_BYTES)
        path = self.file(array, i)
        if not os.path.isfile(path):
            raise DatasetError(f"dataset {path!r} is missing: chunk {i} of {array}; write the dataset again")
        if recorded is not None and os.path.getsize(path) != recorded[i]:
            size = os.path.getsize(path)
            raise DatasetError(f"dataset {path!r} holds {size} bytes, not the {recorded[i]} written: "
                               f"chunk {i} of {array} is truncated or damaged; rewrite it")
        if recorded is not None and getattr(self, array).shards:
            self._check_shard_index(array, i, path)

    def _check_shard_index(self, array: str, i: int, path: str):
        """A shard's index (at its end: (offset, length) of each chunk as uint64, then their
        CRC32C) must list every chunk inside the array: every chunk was written, and zarr would
        read an unlisted one as zeros."""
        values = getattr(self, array)
        per_shard, chunk = values.shards[0] // values.chunks[0], values.chunks[0]
        inside = min(per_shard, -(-(values.shape[0] - i * values.shards[0]) // chunk))
        with open(path, "rb") as f:
            f.seek(-(16 * per_shard + 4), os.SEEK_END)
            index = f.read(16 * per_shard + 4)
        offsets = np.frombuffer(index[:-4], "<u8").reshape(per_shard, 2)[:inside, 0]
        if np.uint32(google_crc32c.value(index[:-4])).tobytes() != index[-4:] or np.any(offsets == UNLISTED):
            raise DatasetError(f"dataset {path!r}: the index of shard {i} of {array} fails its CRC32C "
                               "or lacks a chunk; write the dataset again")

    def check_files(self):
        for array in ARRAYS:
            for i in range(-(-getattr(self, array).shape[0] // file_unit(getattr(self, array)))):
                self.check_file(array, i)


def file_unit(array: zarr.Array) -> int:
    """Elements per file: a shard's, or a chunk's when the array is not sharded."""
    return (array.shards or array.chunks)[0]


@dataclasses.dataclass(frozen=True)
class FlatTokens:
    path: str
    max_token_id: int
    attrs: dict
    splits: dict[str, Split]


_WARNED: set[str] = set()  # datasets without checksums, warned about once


def open_flat_tokens(path: str, check_seq_starts: bool = True) -> FlatTokens:
    """Opens and validates a flat-tokens dataset; every problem is a one-line DatasetError."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DatasetError(f"dataset {path!r} is a file, not a dataset directory; "
                           "set dataset.path to a flat-tokens zarr directory")
    if not os.path.isdir(path):
        raise DatasetError(f"dataset {path!r} does not exist; "
                           "write one with tools/write_synthetic_dataset.py or tools/prepare_dataset.py")
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
            try:
                present = array in sub and isinstance(sub[array], zarr.Array)
            except Exception as e:  # unreadable metadata: zarr raises JSON, value and type errors
                raise DatasetError(f"dataset {path!r}: the metadata of {name}/{array} is unreadable "
                                   f"({type(e).__name__}); write the dataset again") from None
            if not present:
                raise DatasetError(f"dataset {path!r}: split {name!r} has no array {array!r}")
            if sub[array].dtype != dtype or sub[array].ndim != 1:
                raise DatasetError(f"dataset {path!r}: {name}/{array} must be 1-D {np.dtype(dtype)}, "
                                   f"got {sub[array].ndim}-D {sub[array].dtype}")
        split = Split(sub["encoded_tokens"], sub["seq_starts"], os.path.join(path, name))
        if not all(STORED_BYTES in getattr(split, array).attrs for array in ARRAYS) and path not in _WARNED:
            _WARNED.add(path)
            warn(f"dataset {path!r} has no checksums (written before they were added); write it again to check it")
        split.check_files()
        if check_seq_starts:
            _check_seq_starts(path, name, split)
        splits[name] = split
    return FlatTokens(path, attrs["max_token_id"], attrs, splits)


def _check_seq_starts(path: str, name: str, split: Split):
    starts = split.read("seq_starts", 0, split.seq_starts.shape[0])
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
        self.array = group.create_array(
            name, shape=(0,), dtype=dtype, chunks=(chunk,), shards=(shard,) if shard else None,
            compressors=[zarr.codecs.ZstdCodec(level=compression_level), zarr.codecs.Crc32cCodec()],
            config={"write_empty_chunks": True})  # every chunk is written: a missing one is damage
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

    def finish(self, directory: str):
        """Writes the rest, then records the size of every file (the STORED_BYTES attribute)."""
        self._write(final=True)
        unit = file_unit(self.array)
        key = lambda i: os.path.join(directory, *self.array.metadata.encode_chunk_key((i,)).split("/"))  # noqa: E731
        self.array.attrs[STORED_BYTES] = [os.path.getsize(key(i)) for i in range(-(-self.written // unit))]


@contextlib.contextmanager
def disk_errors(path: str):
    """A full disk (or quota), a read-only one or no permission while writing is a one-line DatasetError
    naming the path."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise DatasetError(f"cannot write dataset {path!r}: {e.strerror}; write it where you may (another "
                               "--output)") from None
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DatasetError(f"writing dataset {path!r} failed: {e.strerror or 'no space left'}; "
                           "free space there (or write elsewhere) and run again") from None


class FlatTokensWriter:
    """Streams documents into a new flat-tokens dataset, in memory one write unit per array.

    Everything goes to `<path>.tmp-<random>`; `commit()` writes the attributes (`format` last of
    all) and renames the directory into place, so `path` either does not exist or is complete,
    and an interrupted temporary directory is not a valid dataset. Used as a context manager, an
    exception removes the temporary directory.
    """

    def __init__(self, path: str, overwrite: bool = False, chunk_tokens: int = CHUNK_TOKENS,
                 shard_tokens: int | None = None, compression_level: int = 3):
        if os.path.exists(path) and not overwrite:
            raise DatasetError(f"{path!r} exists; pass --overwrite to replace it")
        if chunk_tokens < 1 or (shard_tokens and shard_tokens % chunk_tokens):
            raise DatasetError(f"chunk_tokens={chunk_tokens} must be positive and divide shard_tokens={shard_tokens}")
        self.path, self.tmp = path, f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        self.max_token_id = 0
        self.tokens = {}
        self.starts = {}
        try:
            with disk_errors(self.tmp):
                self.group = zarr.open_group(self.tmp, mode="w")
                for name in SPLITS:
                    sub = self.group.create_group(name)
                    self.tokens[name] = _Appender(sub, "encoded_tokens", np.uint32, chunk_tokens, shard_tokens,
                                                  compression_level)
                    self.starts[name] = _Appender(sub, "seq_starts", np.uint64, chunk_tokens, shard_tokens,
                                                  compression_level)
                    self.starts[name].append(np.zeros(1, np.uint64))
        except BaseException:
            self.abort()
            raise
        self.num_tokens = dict.fromkeys(SPLITS, 0)
        self.num_documents = dict.fromkeys(SPLITS, 0)

    def add_encoded(self, split: str, encoded: np.ndarray, lengths: np.ndarray):
        """Appends documents already encoded (see encode_documents) with their token counts."""
        if len(encoded):
            self.max_token_id = max(self.max_token_id, int(encoded.max()) >> 1)
        with disk_errors(self.tmp):
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
        with disk_errors(self.tmp):
            out = self.group.create_array(name, shape=(len(data),), dtype=np.uint8, chunks=(max(1, len(data)),),
                                          compressors=[zarr.codecs.ZstdCodec(level=3), zarr.codecs.Crc32cCodec()])
            out[:] = np.frombuffer(data, np.uint8)

    def commit(self, attrs: dict):
        for name in SPLITS:
            if self.num_documents[name] == 0:
                raise DatasetError(f"split {name!r} of {self.path!r} would have no documents")
        with disk_errors(self.tmp):
            for name in SPLITS:
                self.tokens[name].finish(os.path.join(self.tmp, name, "encoded_tokens"))
                self.starts[name].finish(os.path.join(self.tmp, name, "seq_starts"))
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
