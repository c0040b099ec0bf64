"""Checkpoint save and restore throughput against this disk's raw speed, in the same run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.checkpoint_io \\
        [--gb 1.0] [--dir /tmp] [--repeats 3] [--compression none zstd]

The state is --gb of float32 and bfloat16 arrays sharded over a 4x2 mesh, drawn at random (so
zstd finds little to remove, as in real weights). "raw" writes and reads the very same shards
with numpy (`tofile` / `fromfile`, one file per shard, the same number of threads): the speed
of the disk as this process sees it, page cache included. Save is timed from `save()` to the
commit; restore reads onto the saving mesh (one chunk per device) and onto 8x1 (every device
reads parts of two chunks). The machine's load changes from second to second, so each round
measures raw numpy and then the checkpointer, and the figures are medians over rounds.
"""

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train
from seqax.checkpoint import Checkpointer
from seqax.config import CheckpointConfig

THREADS = 8


def make_state(gb: float, mesh) -> dict:
    """Eight f32 matrices and one bf16 matrix, about `gb` GB in all."""
    rows = max(64, int(gb * 1e9 / (8.5 * 4096 * 4)) // 64 * 64)
    rng = np.random.default_rng(0)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    state = {f"w{i}": put(rng.standard_normal((rows, 4096), dtype=np.float32), P("d", "t")) for i in range(8)}
    state["bf16"] = put(rng.standard_normal((rows, 4096), dtype=np.float32).astype(ml_dtypes.bfloat16), P("t", "d"))
    return state


def raw_speeds(state: dict, directory: str) -> tuple[float, float]:
    shards = [(f"{name}.{i}", np.asarray(s.data))
              for name, x in state.items() for i, s in enumerate(x.addressable_shards) if s.replica_id == 0]
    nbytes = sum(a.nbytes for _, a in shards)
    os.makedirs(directory)
    os.sync()  # every timed write starts with no dirty pages from the previous one
    with ThreadPoolExecutor(THREADS) as pool:
        start = time.perf_counter()
        list(pool.map(lambda item: item[1].tofile(os.path.join(directory, item[0])), shards))
        write = time.perf_counter() - start
        start = time.perf_counter()
        list(pool.map(lambda item: np.fromfile(os.path.join(directory, item[0]), dtype=np.uint8), shards))
        read = time.perf_counter() - start
    shutil.rmtree(directory)
    return nbytes / write / 1e9, nbytes / read / 1e9


def checkpoint_speeds(state: dict, directory: str, compression: str, meshes: list) -> tuple[float, float, list[float]]:
    nbytes = sum(x.nbytes for x in state.values())
    checkpointer = Checkpointer(directory, CheckpointConfig(keep=0, compression=compression, level=3, threads=THREADS))
    os.sync()
    start = time.perf_counter()
    checkpointer.save(1, state)
    blocking = time.perf_counter() - start
    checkpointer.wait()
    save = time.perf_counter() - start
    restores = []
    for mesh in meshes:
        shapes = {k: jax.ShapeDtypeStruct(x.shape, x.dtype) for k, x in state.items()}
        shardings = {k: NamedSharding(mesh, x.sharding.spec) for k, x in state.items()}
        start = time.perf_counter()
        _, restored = checkpointer.restore(shapes, shardings)
        jax.block_until_ready(restored)
        restores.append(nbytes / (time.perf_counter() - start) / 1e9)
        del restored
    size = sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(checkpointer.step_dir(1)) for f in files)
    checkpointer.close()
    shutil.rmtree(directory)
    print(f"  {compression}: {size / nbytes:.1%} of the raw size on disk; "
          f"save() blocked {blocking * 1000:.0f} ms (the device-to-host copy), "
          f"then wrote in the background for {(save - blocking) * 1000:.0f} ms", flush=True)
    return (nbytes / save / 1e9, nbytes / (save - blocking) / 1e9), restores


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compression", nargs="+", default=["none", "zstd"])
    args = parser.parse_args(argv)
    mesh, other = train.make_mesh(4, 2), train.make_mesh(8, 1)
    state = make_state(args.gb, mesh)
    nbytes = sum(x.nbytes for x in state.values())
    work = tempfile.mkdtemp(prefix="seqax-bench-", dir=args.dir)
    print(f"state {nbytes / 1e9:.2f} GB in {len(state)} arrays on a 4x2 mesh; directory {work}; {args.repeats} rounds")
    rounds = []  # per round: raw (write, read), then per compression (save, write phase), (restore 4x2, restore 8x1)
    for r in range(args.repeats + 1):  # the first round warms the page cache and is not counted
        raw = raw_speeds(state, os.path.join(work, f"raw{r}"))
        rounds.append((raw, {c: checkpoint_speeds(state, os.path.join(work, f"{c}{r}"), c, [mesh, other])
                             for c in args.compression}))
    shutil.rmtree(work, ignore_errors=True)
    rounds = rounds[1:]

    def figure(get, raw_of) -> str:
        """Median over rounds, in GB/s and as a fraction of raw numpy in the same round."""
        return f"{np.median([get(r) for r in rounds]):.2f} GB/s ({np.median([get(r) / raw_of(r) for r in rounds]):.0%})"

    print("medians over rounds; in brackets, the fraction of raw numpy I/O measured in the same round")
    print(f"raw numpy:  write {np.median([r[0][0] for r in rounds]):.2f} GB/s   "
          f"read {np.median([r[0][1] for r in rounds]):.2f} GB/s")
    for c in args.compression:
        write, read = (lambda r: r[0][0]), (lambda r: r[0][1])
        print(f"{c:5s} save {figure(lambda r, c=c: r[1][c][0][0], write)}, "
              f"write phase alone {figure(lambda r, c=c: r[1][c][0][1], write)}; "
              f"restore onto 4x2 {figure(lambda r, c=c: r[1][c][1][0], read)}, "
              f"onto 8x1 {figure(lambda r, c=c: r[1][c][1][1], read)}")


if __name__ == "__main__":
    main()
