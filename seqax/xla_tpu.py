"""The TPU compiler's flags a run adds to LIBTPU_INIT_ARGS, which libtpu reads once, when JAX first starts
its TPU backend (no other platform reads it): set before any JAX call that looks at devices.

On a TPU, libtpu compiles the all-gathers and reduce-scatters of a shard_map synchronously: the cores
wait for each. A v5p or v6e chip has SparseCores beside its TensorCores, and these flags (MaxText's
ENABLE_SPARSECORE_OFFLOADING_FOR_RS_AG_AR with its base flags, benchmarks/xla_flags_library.py) run
those collectives there, asynchronously, while the TensorCores compute. libtpu's other way to overlap
them, "continuation fusion" (xla_tpu_enable_async_collective_fusion), is refused by libtpu 0.0.46.3 on
both ("not supported/recommended on platforms other than Viperlite ... incorrect results, hang, SDC").
Four more (set by the public TPU recipes for large slices) cover a group that spans more than one of the
torus's dimensions, as FSDP over a whole slice does. docs/performance.md, "TPUs: calibrated against MaxText",
has what they change in tpu8_1b's and the 8B's steps.
"""

import os

SPARSECORE_COLLECTIVES = (
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false",
    "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=false",
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    # A group that spans more than one of the torus's dimensions (FSDP over a whole 16x16 v6e or 4x4x8 v5p slice):
    # without these libtpu runs such a reduce-scatter as an all-reduce of the whole array (twice the bytes, and
    # the whole array in memory) and such an all-gather on the TensorCores, synchronously.
    "--xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true",
    "--xla_tpu_prefer_async_allgather_to_allreduce=true",  # else a v5p runs its all-gathers as all-reduces
    "--xla_tpu_enable_all_gather_offload_tracing=true",  # the offloaded collectives in a profile
    "--xla_tpu_enable_reduce_scatter_offload_tracing=true",
    "--xla_tpu_enable_all_reduce_offload_tracing=true",
    "--xla_tpu_use_tc_device_shape_on_sc=true",
    "--xla_sc_enable_instruction_fusion=false",
    "--xla_sc_disjoint_spmem=false",
    "--xla_sc_disable_megacore_partitioning=true",
)


def add_tpu_flags(environ=os.environ) -> None:
    """Appends to LIBTPU_INIT_ARGS each flag of SPARSECORE_COLLECTIVES whose name it does not set yet: a
    flag the user set there keeps the user's value."""
    given = environ.get("LIBTPU_INIT_ARGS", "")
    named = {flag.split("=", 1)[0] for flag in given.split()}
    added = [flag for flag in SPARSECORE_COLLECTIVES if flag.split("=", 1)[0] not in named]
    environ["LIBTPU_INIT_ARGS"] = " ".join([given, *added]).strip()
