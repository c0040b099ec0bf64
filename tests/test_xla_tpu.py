"""seqax/xla_tpu.py: the TPU compiler's flags a run adds, without overriding the user's."""

from seqax.xla_tpu import SPARSECORE_COLLECTIVES, add_tpu_flags


def test_the_flags_are_added_and_a_users_own_value_wins():
    environ = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_sparse_core_collective_offload_all_gather=false --xla_foo=1"}
    add_tpu_flags(environ)
    flags = environ["LIBTPU_INIT_ARGS"].split()
    assert flags[:2] == ["--xla_tpu_enable_sparse_core_collective_offload_all_gather=false", "--xla_foo=1"]
    assert "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true" not in flags
    assert sorted(flags[2:]) == sorted(f for f in SPARSECORE_COLLECTIVES if "offload_all_gather=" not in f)
    add_tpu_flags(environ)  # twice: nothing more
    assert environ["LIBTPU_INIT_ARGS"].split() == flags
    empty = {}
    add_tpu_flags(empty)
    assert empty["LIBTPU_INIT_ARGS"].split() == list(SPARSECORE_COLLECTIVES)
