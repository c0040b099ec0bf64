"""One process of tests/test_checkpoint.py's multi-process check (not collected by pytest).

    python tests/checkpoint_process.py PORT NUM_PROCESSES PROCESS_ID CHECKPOINT_DIR

Every process builds the same global tree (`sample_values`) on a 4x2 mesh over all processes'
devices (one leaf on an 8x1 mesh whose devices alternate between the processes), saves it as
step 3 (each process writing the shards it owns), then every process restores it on a 2x4 mesh
and checks the shards it holds.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from seqax.checkpoint import Checkpointer
from seqax.config import CheckpointConfig  # noqa: E402


def sample_values() -> dict:
    """Global values and partition specs: f32 and bf16 (with nan, inf, -0 and a subnormal)
    leaves sharded several ways, a replicated vector, a scalar and an array of zeros."""
    rng = np.random.default_rng(0)
    bf16 = rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16)
    bf16[0, :4] = [np.nan, np.inf, -0.0, 1e-40]
    return {
        "weights": {"w": (rng.standard_normal((8, 4)).astype(np.float32), P("d", "t")), "b": (bf16, P(None, "t"))},
        "norm": (rng.standard_normal(5).astype(np.float32), P()),
        "count": (np.uint32(7), P()),
        "layers": [(rng.standard_normal((2, 16, 8)).astype(np.float32), P(None, "t", "d"))],
        "interleaved": (rng.standard_normal((16, 4)).astype(np.float32), P("d")),
        "zeros": (np.zeros((8, 4), np.float32), P("d", "t")),  # as Adam's moments start
    }


def is_spec_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)


def put(values: dict, mesh) -> dict:
    """The global arrays of `values` on `mesh`; every process supplies only its shards."""
    def one(value, spec):
        return jax.make_array_from_callback(np.shape(value), NamedSharding(mesh, spec),
                                            lambda index: np.asarray(np.asarray(value)[index]))

    return jax.tree.map(lambda v: one(*v), values, is_leaf=is_spec_pair)


def main():
    port, n, pid, directory = sys.argv[1:5]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(n), process_id=int(pid))
    auto = (jax.sharding.AxisType.Auto,) * 2
    values = sample_values()
    checkpointer = Checkpointer(directory, CheckpointConfig(keep=0, compression="none", level=0, threads=4))
    tree = put(values, jax.make_mesh((4, 2), ("d", "t"), axis_types=auto))
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    alternating = jax.sharding.Mesh(np.array([d for ds in zip(*by_process) for d in ds]).reshape(8, 1), ("d", "t"),
                                    axis_types=auto)
    tree["interleaved"] = put({"x": values["interleaved"]}, alternating)["x"]
    checkpointer.save(3, tree)
    checkpointer.wait()
    mesh = jax.make_mesh((2, 4), ("d", "t"), axis_types=auto)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v[0]), v[0].dtype), values, is_leaf=is_spec_pair)
    shardings = jax.tree.map(lambda v: NamedSharding(mesh, v[1]), values, is_leaf=is_spec_pair)
    step, tree = checkpointer.restore(shapes, shardings)
    checkpointer.close()
    assert step == 3
    for x, v in zip(jax.tree.leaves(tree), jax.tree.leaves(values, is_leaf=is_spec_pair)):
        for shard in x.addressable_shards:
            assert np.asarray(shard.data).tobytes() == np.asarray(v[0])[shard.index].tobytes()


if __name__ == "__main__":
    main()
