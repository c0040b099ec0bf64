"""One process of tests/test_data_loader.py's multi-process check (not collected by pytest).

    python tests/loader_process.py PORT NUM_PROCESSES PROCESS_ID DATASET OUT_DIR STEPS...

Builds the loader on a 4x2 mesh over all processes' devices, assembles the global batch of each
step from the rows this process reads, gathers it to every process and saves it (process 0), and
saves the row ranges this process read.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from seqax.config import DatasetConfig
from seqax.data.data_loader import make_loader  # noqa: E402
from seqax.data.flat_tokens import open_flat_tokens  # noqa: E402


def main():
    port, n, pid, path, out = sys.argv[1:6]
    steps = [int(s) for s in sys.argv[6:]]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(n), process_id=int(pid))
    mesh = jax.make_mesh((4, 1, 2), ("d", "c", "t"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    h = DatasetConfig(path=path, packed=True, seed=3, streams=2, read_block_tokens=64,
                      shuffle_buffer_tokens=1024, prefetch=1)
    loader = make_loader(h, open_flat_tokens(path), "train", 8, 16, mesh)
    result = {}
    for step in steps:
        batch = loader.batch(step)
        for name in ("targets", "is_seq_start", "loss_mask"):
            result[f"{name}_{step}"] = multihost_utils.process_allgather(getattr(batch, name), tiled=True)
    loader.close()
    np.save(os.path.join(out, f"rows_{pid}.npy"), np.array(loader.local_rows))
    if int(pid) == 0:
        np.savez(os.path.join(out, "batches.npz"), **result)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main()
