"""The flat-tokens dataset format (docs/flat-tokens.md): open, validate, write.

A zarr v3 group with one subgroup per split (`train`, `validation`). Each split holds
  encoded_tokens  uint32[N]   token_id * 2 + is_start (1 on the first token of a document)
  seq_starts      uint64[D+1] offset of each document in encoded_tokens, then N
and the group's attributes hold `max_token_id` (the largest token id in any split) and
`format` = "flat-tokens/1". A dataset is written to a temporary name and renamed into place,
so a path that exists is complete.
"""

import dataclasses
import os
import shutil
import uuid

import numpy as np
import zarr

FORMAT = "flat-tokens/1"
SPLITS = ("train", "validation")
CHUNK_TOKENS = 1 << 20


class DatasetError(ValueError):
    """The dataset on disk is missing or malformed; the message names the path and the problem."""


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


def write_flat_tokens(path: str, splits: dict[str, list[np.ndarray]], attrs: dict, overwrite: bool = False):
    """Writes documents per split; the dataset appears at `path` only once complete."""
    if os.path.exists(path) and not overwrite:
        raise DatasetError(f"{path!r} exists; pass --overwrite to replace it")
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    group = zarr.open_group(tmp, mode="w")
    max_token_id = 0
    for name in SPLITS:
        encoded, seq_starts = encode_documents(splits[name])
        max_token_id = max(max_token_id, int(encoded.max() >> 1))
        sub = group.create_group(name)
        for array, data in (("encoded_tokens", encoded), ("seq_starts", seq_starts)):
            out = sub.create_array(array, shape=data.shape, dtype=data.dtype, chunks=(min(CHUNK_TOKENS, max(1, len(data))),),
                                   compressors=zarr.codecs.ZstdCodec(level=3))
            out[:] = data
    group.attrs.update({**attrs, "format": FORMAT, "max_token_id": max_token_id})
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
