"""Several processes, one per host, on JAX's own multi-controller runtime (`jax.distributed`):
whether a run joins others and with which settings, from the `distributed:` config section, the
usual environment variables, or the cluster (SLURM, Open MPI, TPU pods). docs/multi-host.md
has the recipes; tools/launch_local.py runs N processes on one machine.

Every process runs the same program on its own devices; the mesh spans the devices of all of
them, and each process loads, computes and writes only what its devices hold.
"""

import os
import sys

import jax
from jax.experimental import mesh_utils

from seqax import watchdog
from seqax.config import ConfigError, DistributedConfig, DistributedError, SeqaxError
from seqax.console import first_line, signature
from seqax.signals import exit_on_signal


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} must be an integer") from None


def cluster_process_count() -> int | None:
    """How many processes the cluster started, read from the variables by which JAX's auto-detection
    recognizes it: SLURM (one task per host), Open MPI (mpirun), TPU VMs of a pod or multislice."""
    env = os.environ
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")):
        return _env_int("SLURM_NTASKS")
    if "OMPI_MCA_orte_hnp_uri" in env:
        return _env_int("OMPI_COMM_WORLD_SIZE")
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if hosts:
        return len(hosts.split(",")) * (_env_int("MEGASCALE_NUM_SLICES") or 1)
    return None


def resolve(distributed: DistributedConfig) -> dict | None:
    """The keyword arguments of jax.distributed.initialize for this process, or None for a
    single-process run. Unknown values stay None, for JAX to detect."""
    if distributed.num_processes < 0 or distributed.process_id < -1:
        raise ConfigError(f"distributed.num_processes={distributed.num_processes} and "
                          f"distributed.process_id={distributed.process_id} must be "
                          "0 / -1 (read the environment) or a count and an index")
    if distributed.heartbeat_timeout_seconds < 1 or distributed.initialization_timeout_seconds < 1:
        raise ConfigError("distributed.heartbeat_timeout_seconds and distributed.initialization_timeout_seconds "
                          "must be positive")
    num = distributed.num_processes or _env_int("JAX_NUM_PROCESSES") or cluster_process_count() or 1
    if num == 1:
        return None
    process_id = distributed.process_id if distributed.process_id >= 0 else _env_int("JAX_PROCESS_ID")
    if process_id is not None and not 0 <= process_id < num:
        raise ConfigError(f"process id {process_id} is not in 0..{num - 1} for {num} processes; "
                          "set distributed.process_id (or $JAX_PROCESS_ID) to this process's index")
    return dict(
        coordinator_address=distributed.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None,
        num_processes=num, process_id=process_id, initialization_timeout=distributed.initialization_timeout_seconds,
        heartbeat_timeout_seconds=distributed.heartbeat_timeout_seconds,
        shutdown_timeout_seconds=distributed.heartbeat_timeout_seconds)


# JAX's own timeouts are this much longer than ours, so that the watchdog (watchdog.py) names a lost or
# missing process before JAX's runtime aborts the process natively.
RUNTIME_MARGIN_S = 10


def initialize_distributed(distributed: DistributedConfig):
    """Joins the other processes of the run, if there are any. Must run before any other JAX
    call: the devices of every process then make jax.devices()."""
    settings = resolve(distributed)
    if settings is None:
        return
    # A collective whose peer died fails after this long instead of waiting forever.
    flag = f"--xla_cpu_collective_timeout_seconds={distributed.heartbeat_timeout_seconds}"
    if "xla_cpu_collective_timeout_seconds" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    where = settings["coordinator_address"] or "the detected coordinator"
    watched = settings["coordinator_address"] is not None and settings["process_id"] is not None
    if watched:  # before joining: a process that dies or never comes while the others wait is named too
        watchdog.start(settings["process_id"], settings["num_processes"], settings["coordinator_address"],
                       distributed.heartbeat_timeout_seconds, distributed.initialization_timeout_seconds)
    runtime = {**settings, "initialization_timeout": settings["initialization_timeout"] + RUNTIME_MARGIN_S,
               "heartbeat_timeout_seconds": settings["heartbeat_timeout_seconds"] + RUNTIME_MARGIN_S}
    try:
        jax.distributed.initialize(**runtime)
    except (ValueError, TypeError) as e:
        raise DistributedError(f"cannot join a run of {settings['num_processes']} processes: "
                               f"{e.__str__().rstrip('.')}; set distributed.coordinator_address and "
                               "distributed.process_id (or $JAX_COORDINATOR_ADDRESS and $JAX_PROCESS_ID), "
                               "or run under SLURM, Open MPI or a TPU pod (docs/multi-host.md)") from None
    except Exception as e:  # the runtime's errors (a timeout connecting) are its own classes
        first = first_line(e)
        who = "this process" if settings["process_id"] is None else f"process {settings['process_id']}"
        raise DistributedError(f"{who} could not join the {settings['num_processes']} processes "
                               f"at {where} within {distributed.initialization_timeout_seconds} s: {first}") from None
    state = getattr(getattr(getattr(jax, "_src", None), "distributed", None), "global_state", None)  # JAX's, not public
    address = getattr(state, "coordinator_address", None)  # what JAX detected
    if not watched and address:
        watchdog.start(jax.process_index(), jax.process_count(), address, distributed.heartbeat_timeout_seconds,
                       distributed.initialization_timeout_seconds)


def wait_for_all_processes(name: str, timeout_s: int):
    """Returns when every process of the run has called it with `name` (at once with one process).
    Before the first step: process 0 writes the start-up reports while the others wait here,
    since the first collective of a new group of devices gives up when a peer is 30 s late (gloo's
    fixed deadline on CPUs), and compile times differ by that much on a busy machine. It uses
    the coordination service's barrier, with `timeout_s`; JAX exposes its client only privately."""
    if jax.process_count() == 1:
        return
    client = jax._src.distributed.global_state.client  # no public API for the barrier (JAX 0.10.2)
    try:
        client.wait_at_barrier(f"seqax_{name}", timeout_s * 1000)
    except Exception as e:  # the runtime's errors are its own classes
        first = first_line(e)
        watchdog.stop(jax.process_index(), f"the processes did not all reach {name} within {timeout_s} s: {first}")


def console_name() -> str:
    """How this process signs its console lines: `seqax` on process 0, `seqax[process i]` elsewhere."""
    return signature(jax.process_index() if jax.distributed.is_initialized() else 0)


def exit_if_peer_lost(error: Exception):
    """In a run of several processes, a collective whose peer died fails with a runtime error
    (its connection is reset, or it times out): print one line naming the lost process (when the
    watchdog found it) or the failure, and exit 1. With one process, return, so the caller
    re-raises the error with its traceback."""
    if jax.process_count() == 1:
        return
    lost = watchdog.lost_peer(wait=2.0)  # the watchdog sees the same closed connection within milliseconds
    if lost is not None:
        watchdog.stop_for_lost_peer(jax.process_index(), *lost)
    first = first_line(error)
    watchdog.stop(jax.process_index(), f"{first}; with {jax.process_count()} processes this usually means that "
                                       "another process died (see its log)")


def make_mesh(d: int, t: int, c: int = 1, devices=None) -> jax.sharding.Mesh:
    """The (d, c, t) mesh over `devices` (default: all, of every process): t innermost (its
    collectives are the most frequent), then the ring c. Auto axes: arrays are placed with the
    NamedShardings derived from their annotations, so no explicit-sharding types are needed. Each axis is
    laid over whole axes of the devices' physical torus where it can be; where it cannot (c=2 on a 16x16 TPU
    slice, whose axes are 16), a physical axis is split between mesh axes."""
    axis_types = (jax.sharding.AxisType.Auto,) * 3
    try:
        return jax.make_mesh((d, c, t), ("d", "c", "t"), axis_types=axis_types, devices=devices)
    except NotImplementedError:  # JAX's message: no subset of the physical axes has that size
        grid = mesh_utils.create_device_mesh((d, c, t), devices, allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, ("d", "c", "t"), axis_types=axis_types)


def run_program(program):
    """Runs `program()`, the whole of a command that may be one of several processes: SIGTERM or
    Ctrl-C stops it with one line, outside its training loop (signals.py); a SeqaxError is printed as one line
    (process 0 stops the others with a line first) and exits 2; a lost peer is named in one line."""
    exit_on_signal(lambda: signature(watchdog.process_index()))
    try:
        program()
        watchdog.leave()  # the other processes' watchdogs take this exit for a finish, not a death
    except SeqaxError as e:
        print(f"{console_name()}: error: {e}", file=sys.stderr, flush=True)
        watchdog.leave(error=True)
        sys.exit(2)
    except jax.errors.JaxRuntimeError as e:
        exit_if_peer_lost(e)  # several processes: one line naming the likely cause, then exit
        raise
