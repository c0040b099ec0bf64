"""One sharded jax.Array as one zarr v3 array, written and read chunk by chunk with checksums.

The layout follows the array's sharding (docs/checkpoint-format.md): a chunk is one device's
shard, written by the device holding replica 0 of it. The chunks that one process writes form,
on a regular mesh, equal boxes on a grid; each box is then one file, using zarr's sharding codec
(`shards`). Otherwise (and for scalars, which zarr 3.1 cannot shard) each chunk is its own file.
Every chunk, and every shard's index, ends with its CRC32C.

Uncompressed data takes a direct path: a process writes its chunks straight into their places
in the shard file and reads a chunk into its final buffer, the very bytes zarr's codecs would
write and accept. Compressed data goes through zarr.
"""

import dataclasses
import errno
import itertools
import os
from functools import partial

import google_crc32c
import numpy as np
import zarr

MISSING = 2**64 - 1  # a shard index's offset and length of a chunk that was never written
PIECE = 1 << 22  # bytes checksummed and written at a time


class DamagedChunk(Exception):
    """A chunk or shard index that is missing, truncated or fails its checksum."""


@dataclasses.dataclass(frozen=True)
class Layout:
    chunks: tuple  # one device's shard on the saving mesh
    shards: tuple | None  # the box of chunks one process writes as one file; None: a file per chunk


def region(index: tuple, shape: tuple) -> tuple:
    """An index (a tuple of slices) as ((start, stop), ...) over every dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def slices(r: tuple) -> tuple:
    return tuple(slice(a, b) for a, b in r)


def box(coords: tuple, size: tuple) -> tuple:
    """The region of the block at `coords` of a grid of blocks of `size`."""
    return tuple((c * n, (c + 1) * n) for c, n in zip(coords, size))


def overlapping(r: tuple, size: tuple) -> list[tuple]:
    """Coordinates of the blocks of `size` that overlap region `r`."""
    return list(itertools.product(*(range(a // n, -(-b // n)) for (a, b), n in zip(r, size))))


def plan(sharding, shape: tuple) -> Layout:
    """The layout of an array sharded by `sharding`. Chunk c is written by the process of the
    first device holding it, the one JAX numbers replica 0."""
    chunks = tuple(max(n, 1) for n in sharding.shard_shape(shape))  # an empty array (no chunk): zarr's least
    writer = {}
    for device, index in sharding.devices_indices_map(shape).items():
        writer.setdefault(tuple(a // n for (a, _), n in zip(region(index, shape), chunks)), device.process_index)
    per_process = {}
    for coords, process in writer.items():
        per_process.setdefault(process, []).append(coords)
    boxes = set()
    for coords in per_process.values():
        low, high = np.min(coords, axis=0), np.max(coords, axis=0) + 1
        if np.prod(high - low) != len(coords) or np.any(low % (high - low)):
            return Layout(chunks, None)
        boxes.add(tuple(int(n) for n in high - low))
    if not shape or len(boxes) != 1:
        return Layout(chunks, None)
    return Layout(chunks, tuple(n * c for n, c in zip(boxes.pop(), chunks)))


def create(group: zarr.Group, name: str, shape: tuple, dtype: np.dtype, layout: Layout, compressors: list,
           attributes: dict) -> zarr.Array:
    return group.create_array(
        name,
        shape=shape,
        dtype=dtype,
        chunks=layout.chunks,
        shards=layout.shards,
        compressors=compressors,  # the last is crc32c
        fill_value=0,
        chunk_key_encoding={"name": "default", "separator": "/"},  # file (i, j) is c/i/j
        attributes=attributes,
        config={"write_empty_chunks": True},  # every chunk is written: a missing one is damage
    )


def is_raw(array: zarr.Array) -> bool:
    """True for uncompressed little-endian chunks followed by their CRC32C (the direct path)."""
    codecs = array.metadata.codecs
    if array.shards is not None:
        index = [c.to_dict() for c in codecs[0].index_codecs]
        if [c["name"] for c in index] != ["bytes", "crc32c"] or codecs[0].index_location.value != "end":
            return False
        codecs = codecs[0].codecs
    codecs = [c.to_dict() for c in codecs]
    return ([c["name"] for c in codecs] == ["bytes", "crc32c"]
            and codecs[0].get("configuration", {}).get("endian", "little") == "little")


def file_path(array_dir: str, array: zarr.Array, coords: tuple) -> str:
    """The file of the shard (or, unsharded, the chunk) at `coords`."""
    return os.path.join(array_dir, *array.metadata.encode_chunk_key(coords).split("/"))


def _crc(data) -> bytes:
    return np.uint32(google_crc32c.value(data)).tobytes()


def _bytes(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def write_jobs(array_dir: str, layout: Layout, data: dict[tuple, np.ndarray], array: zarr.Array | None) -> list[list]:
    """The writes of this process's chunks (`data`, by chunk coordinates, of the stored dtype) as
    callables, one list per file; they may run in any order and in parallel. `array` is None
    for the direct path."""
    if layout.shards is None:
        if array is not None:
            return [[partial(_set_below, array_dir, c, array, slices(box(c, layout.chunks)), d)]
                    for c, d in data.items()]
        return [[partial(_write_at, os.path.join(array_dir, "c", *map(str, c)), 0, d, array_dir)]
                for c, d in data.items()]
    per_shard = tuple(s // c for s, c in zip(layout.shards, layout.chunks))
    shards: dict[tuple, dict] = {}
    for c, d in data.items():
        shards.setdefault(tuple(i // k for i, k in zip(c, per_shard)), {})[c] = d
    if array is not None:  # zarr compresses the shard's chunks and writes its index

        def write_shard(s, chunks):
            array[slices(box(s, layout.shards))] = assemble(box(s, layout.shards), layout.chunks, chunks)

        return [[partial(write_shard, s, chunks)] for s, chunks in shards.items()]
    files = []
    for s, chunks in shards.items():
        # Chunks in C order, each followed by its CRC32C; then the index: (offset, length) of
        # every chunk as little-endian uint64 in C order, and its CRC32C.
        path, size = os.path.join(array_dir, "c", *map(str, s)), next(iter(chunks.values())).nbytes + 4
        index = np.array([(k * size, size) for k in range(len(chunks))], "<u8")
        first = tuple(i * k for i, k in zip(s, per_shard))
        position = {c: int(np.ravel_multi_index(tuple(i - f for i, f in zip(c, first)), per_shard)) for c in chunks}
        files.append([partial(_write_at, path, len(chunks) * size, index, array_dir)]
                     + [partial(_write_at, path, position[c] * size, d, array_dir) for c, d in chunks.items()])
    return files


def _makedirs_below(root: str, folder: str):
    """Makes `folder` and the folders between it and `root` (which must exist), never `root` or anything
    above it: each level is made by mkdir in its parent, which fails (FileNotFoundError) once `root` is gone."""
    made = root
    for part in os.path.relpath(folder, root).split(os.sep):
        if part != os.curdir:
            made = os.path.join(made, part)
            try:
                os.mkdir(made)
            except FileExistsError:
                pass
    if made == root and not os.path.isdir(root):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", root)


def _set_below(array_dir: str, chunk: tuple, array: zarr.Array, where: tuple, data: np.ndarray):
    """zarr's write of one compressed chunk, whose folders are first made below `array_dir` as _write_at
    makes them (zarr would make every missing folder up to the root, a deleted run directory included)."""
    _makedirs_below(array_dir, os.path.dirname(os.path.join(array_dir, "c", *map(str, chunk))))  # a scalar's is "c"
    array[where] = data


def _write_at(path: str, offset: int, data: np.ndarray, array_dir: str):
    """Writes `data` at `offset` of the file (created if need be), followed by its CRC32C. The
    checksum is computed piece by piece just before each piece is written, while it is in cache.
    Folders are made below `array_dir` only, which must exist: a checkpoint deleted while it is
    written (its run directory removed under a live run) is not made again around its chunks."""
    _makedirs_below(array_dir, os.path.dirname(path))
    flat, crc = _bytes(data), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for start in range(0, flat.nbytes, PIECE):
            piece = flat[start : start + PIECE]
            crc = google_crc32c.extend(crc, piece)
            os.pwrite(fd, piece, offset + start)
        os.pwrite(fd, np.uint32(crc).tobytes(), offset + flat.nbytes)
    except OSError as e:  # a full disk's failed write names no file: this one
        raise OSError(e.errno, e.strerror, path) from e
    finally:
        os.close(fd)


def empty(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """np.empty aligned to 64 bytes, which a CPU device adopts without a copy."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buffer = np.empty(nbytes + 64, np.uint8)
    start = -buffer.ctypes.data % 64
    return buffer[start : start + nbytes].view(dtype).reshape(shape)


def _read_verified(path: str, offset: int, out: np.ndarray, what: str):
    """Fills `out` from `path` at `offset` and checks the CRC32C that follows it."""
    flat = _bytes(out)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            n = f.readinto(flat)
            stored = f.read(4)
    except FileNotFoundError:
        raise DamagedChunk(f"{path} is missing") from None
    if n != flat.nbytes or _crc(flat) != stored:
        raise DamagedChunk(f"{what} in {path} is truncated or fails its CRC32C checksum")


def read_index(array_dir: str, array: zarr.Array, shard: tuple) -> np.ndarray:
    """The verified index of a shard file: (offset, length) of each chunk, by position."""
    per_shard = tuple(s // c for s, c in zip(array.shards, array.chunks))
    path = file_path(array_dir, array, shard)
    index = np.empty(per_shard + (2,), "<u8")
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    if size < index.nbytes + 4:
        raise DamagedChunk(f"shard {path} is missing or truncated")
    _read_verified(path, size - index.nbytes - 4, index, "the shard index")
    if np.any(index == MISSING):
        raise DamagedChunk(f"shard {path} lacks some of its chunks")
    if np.any(index[..., 0] + index[..., 1] > size - index.nbytes - 4):
        raise DamagedChunk(f"shard {path} is truncated")
    return index


def read_chunk(array_dir: str, array: zarr.Array, coords: tuple, index: np.ndarray | None) -> np.ndarray:
    """One whole chunk, verified; `index` is its shard's (None for an unsharded array)."""
    where = box(coords, array.chunks)
    if array.shards is None:
        path, offset, length = file_path(array_dir, array, coords), 0, None
        if not os.path.isfile(path):
            raise DamagedChunk(f"chunk {path} is missing")
    else:
        per_shard = tuple(s // c for s, c in zip(array.shards, array.chunks))
        path = file_path(array_dir, array, tuple(c // k for c, k in zip(coords, per_shard)))
        offset, length = (int(v) for v in index[tuple(c % k for c, k in zip(coords, per_shard))])
    if not is_raw(array):
        return np.asarray(array[slices(where)])
    out = empty(array.chunks, np.dtype(array.dtype))
    if length is not None and length != out.nbytes + 4:
        raise DamagedChunk(f"chunk {coords} of {path} has {length} bytes, expected {out.nbytes + 4}")
    _read_verified(path, offset, out, f"chunk {coords}")
    if length is None and os.path.getsize(path) != out.nbytes + 4:
        raise DamagedChunk(f"chunk {path} has extra bytes")
    return out


def assemble(r: tuple, chunk_shape: tuple, chunks: dict[tuple, np.ndarray]) -> np.ndarray:
    """The block `r` of an array from `chunks` (coordinates -> data), which cover it."""
    if len(chunks) == 1:
        [(coords, data)] = chunks.items()
        if box(coords, chunk_shape) == tuple(r):
            return data  # exactly one saved chunk: no copy
    out = empty(tuple(b - a for a, b in r), next(iter(chunks.values())).dtype)
    for coords, data in chunks.items():
        bounds = [(max(a, s), min(b, e), a, s) for (a, b), (s, e) in zip(r, box(coords, chunk_shape))]
        out[tuple(slice(lo - a, hi - a) for lo, hi, a, _ in bounds)] = data[
            tuple(slice(lo - s, hi - s) for lo, hi, _, s in bounds)]
    return out
