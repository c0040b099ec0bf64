"""Several processes, one per host, on JAX's own multi-controller runtime (`jax.distributed`):
whether a run joins others and with which settings, from the `distributed:` config section, the
usual environment variables, or the cluster (SLURM, Open MPI, TPU pods). docs/multi-host.md
has the recipes; tools/launch_local.py runs N processes on one machine.

Every process runs the same program on its own devices; the mesh spans the devices of all of
them, and each process loads, computes and writes only what its devices hold.
"""

import os
import signal
import socket
import sys
import threading
import time

import jax

from seqax.config import ConfigError, DistributedConfig, DistributedError, SeqaxError


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


# JAX's own timeouts are this much longer than ours, so that the watchdog (below) names a lost or
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
        start_watchdog(settings["process_id"], settings["num_processes"], settings["coordinator_address"],
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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        who = "this process" if settings["process_id"] is None else f"process {settings['process_id']}"
        raise DistributedError(f"{who} could not join the {settings['num_processes']} processes "
                               f"at {where} within {distributed.initialization_timeout_seconds} s: {first}") from None
    state = getattr(getattr(getattr(jax, "_src", None), "distributed", None), "global_state", None)  # JAX's, not public
    address = getattr(state, "coordinator_address", None)  # what JAX detected
    if not watched and address:
        start_watchdog(jax.process_index(), jax.process_count(), address, distributed.heartbeat_timeout_seconds,
                       distributed.initialization_timeout_seconds)


def console_name() -> str:
    """How this process signs its console lines: `seqax` on process 0, `seqax[process i]` elsewhere."""
    if jax.distributed.is_initialized() and jax.process_index() != 0:
        return f"seqax[process {jax.process_index()}]"
    return "seqax"


# The exit status of a process stopped by SIGTERM before its training loop began: 128 + SIGTERM,
# what a shell reports for a process that SIGTERM ended.
SIGTERM_STATUS = 128 + signal.SIGTERM


def exit_on_sigterm():
    """Until the training loop's PreemptionWatch takes over, SIGTERM stops the program with one
    line and SIGTERM_STATUS: before the first step there is no new step to checkpoint, and every
    file on disk survives an exit at any moment. (With several processes, JAX's preemption
    service takes over SIGTERM once the process has joined: the run then saves after its next step.)"""
    def on_sigterm(signum, frame):
        os.write(2, f"{_sign(_watch.get('process', 0))}: error: stopped by SIGTERM before the training loop, "
                    "with no step to save; a restart resumes from the newest checkpoint\n".encode())
        os._exit(SIGTERM_STATUS)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def exit_if_peer_lost(error: Exception):
    """In a run of several processes, a collective whose peer died fails with a runtime error
    (its connection is reset, or it times out): print one line naming the lost process (when the
    watchdog found it) or the failure, and exit 1. With one process, return, so the caller
    re-raises the error with its traceback."""
    if jax.process_count() == 1:
        return
    lost = lost_peer(wait=2.0)  # the watchdog sees the same closed connection within milliseconds
    if lost is not None:
        _lost(jax.process_index(), *lost)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    _stop(jax.process_index(),
          f"{first}; with {jax.process_count()} processes this usually means that another process died (see its log)")


# ---- the liveness watchdog ----
#
# JAX's runtime ends a process natively (SIGABRT and a C++ stack) when it finds a peer gone: at
# once when the coordinator dies, after the heartbeat timeout for another process, and when a
# peer never joins. So that the user sees one line instead, every process also holds a TCP
# connection of its own to process 0 (the coordinator's host, its port + 1), over which both
# sides send a byte every few seconds. A closed or silent connection means a lost process: the
# watchdog prints one line naming it and exits 1 before the runtime's abort fires. Process 0
# passes the news on to the others, so every process names the one that died first.

LIVENESS_PORT_OFFSET = 1  # process 0's liveness server listens on the coordinator's port + this
# a heartbeat; "I exit on purpose"; "L<j>\n": process j was lost; "process 0 stops with an error"
BEAT, BYE, LOST, ERROR = b".", b"B", b"L", b"E"
_watch: dict = {}
_stopping = threading.Lock()


def _sign(process_id: int) -> str:
    return "seqax" if process_id == 0 else f"seqax[process {process_id}]"


def _tell_others(notice: bytes, wait: float):
    """Process 0: sends `notice` to every other process, then waits up to `wait` s for them to
    close their connections, i.e. to exit with their own line: while process 0 lives, their JAX
    runtimes have no reason to abort natively."""
    for conn in list(_watch.get("peers", {}).values()):
        try:
            conn.sendall(notice)
        except OSError:
            pass
    deadline = time.monotonic() + wait
    while set(_watch.get("peers", {})) - _watch["closed"] and time.monotonic() < deadline:
        time.sleep(0.01)


def _stop(process_id: int, line: str, notice: bytes = ERROR):
    """Prints `line` signed by this process and exits 1; process 0 first tells the others (`notice`).
    Only the first caller prints."""
    if _stopping.acquire(blocking=False):
        os.write(2, f"{_sign(process_id)}: error: {line}\n".encode(errors="replace"))
        if process_id == 0 and "closed" in _watch:
            _tell_others(notice, wait=2.0)
        os._exit(1)  # not sys.exit: jax.distributed's shutdown would wait for the dead process
    threading.Event().wait()  # another thread is exiting the process


def _lost(process_id: int, peer: int, why: str):
    _watch.setdefault("lost", (peer, why))
    _stop(process_id, f"lost process {peer} ({why}); stopping this process too "
                      "(restart the run: it resumes from the newest checkpoint)",
          LOST + f"{peer}\n".encode())  # process 0 tells the others which process died first


def _beat(process_id: int, conns, period: float):
    while True:
        for conn in list(conns()):
            try:
                conn.sendall(BEAT)
            except OSError:
                pass  # the reader sees the loss
        time.sleep(period)


def _listen(process_id: int, peer: int, conn: socket.socket, timeout: float):
    """Reads `peer`'s connection until it closes, goes silent or says goodbye."""
    conn.settimeout(timeout)
    while True:
        try:
            data = conn.recv(64)
        except TimeoutError:
            _lost(process_id, peer, f"no heartbeat for {timeout:.0f} s: its host may be down or unreachable")
        except OSError:
            data = b""
        if not data:
            _watch["closed"].add(peer)
            if _watch.get("leaving"):  # this process is exiting on purpose: the peer closed in answer to its goodbye
                return
        if ERROR in data:
            _lost(process_id, 0, "it stopped with an error: see its line")
        if BYE in data:
            _watch["peers"].pop(peer, None)
            conn.close()  # the answer to a goodbye: the leaving process waits for it (leave)
            return
        if LOST in data:
            reported = data[data.index(LOST) + 1:].split(b"\n")[0]
            _lost(process_id, int(reported) if reported.isdigit() else 0, "process 0 reports it gone")
        if not data:
            _lost(process_id, peer, "its connection closed: it exited or was killed")


def _serve(process_id: int, num: int, server: socket.socket, timeout: float, join_timeout: float):
    """Process 0: accepts one connection from every other process, then watches each."""
    server.settimeout(1.0)
    deadline = time.monotonic() + join_timeout
    while len(_watch["peers"]) < num - 1:
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, num)) - set(_watch["peers"]))
            _stop(process_id, f"process(es) {missing} did not join within {join_timeout:.0f} s "
                              f"(distributed.initialization_timeout_seconds); "
                              "check that they started and can reach this host")
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(join_timeout)
        peer = int(conn.recv(16).split(b"\n")[0])
        _watch["peers"][peer] = conn
        threading.Thread(target=_listen, args=(0, peer, conn, timeout), daemon=True,
                         name=f"seqax-liveness-{peer}").start()


def _connect(process_id: int, host: str, port: int, join_timeout: float) -> socket.socket:
    deadline = time.monotonic() + join_timeout
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            conn.sendall(f"{process_id}\n".encode())
            return conn
        except OSError as e:
            if time.monotonic() > deadline:
                _stop(process_id, f"could not reach process 0 at {host}:{port} within {join_timeout:.0f} s ({e}); "
                                  "check that it started and that this port (the coordinator's + 1) "
                                  "is open between the hosts")
            time.sleep(0.2)


def start_watchdog(process_id: int, num: int, coordinator: str, timeout: float, join_timeout: float):
    """Starts watching the other processes (see above): process 0 serves, the others connect."""
    host, port = coordinator.rsplit(":", 1)
    port, period = int(port) + LIVENESS_PORT_OFFSET, max(0.5, timeout / 5)
    _watch.update(process=process_id, peers={}, closed=set())
    if process_id == 0:
        bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").rsplit(":", 1)[0] or ""
        server = socket.create_server((bind.strip("[]"), port), reuse_port=False)
        threading.Thread(target=_serve, args=(0, num, server, timeout, join_timeout), daemon=True,
                         name="seqax-liveness").start()
    else:
        def connect_and_listen():
            conn = _connect(process_id, host.strip("[]"), port, join_timeout)
            _watch["peers"][0] = conn
            _listen(process_id, 0, conn, timeout)
        threading.Thread(target=connect_and_listen, daemon=True, name="seqax-liveness").start()
    threading.Thread(target=_beat, args=(process_id, lambda: _watch["peers"].values(), period), daemon=True,
                     name="seqax-heartbeat").start()


def leave(error: bool = False):
    """Tells the other processes that this one exits on purpose: a finished or preempted run
    (so that its closing connection is not taken for a death), or, on process 0, after an error
    (the others then stop with a line naming it before this process's exit can abort them)."""
    if error:
        if _watch and _stopping.acquire(blocking=False):  # this process's line is out: the watchdog prints no other
            if _watch["process"] == 0:
                _tell_others(ERROR, wait=2.0)
                sys.stdout.flush()
                os._exit(2)  # not sys.exit: jax.distributed's shutdown would wait for the stopped processes
        return
    # The goodbye must arrive. A process that exits with bytes unread on a connection (a
    # heartbeat that came in just before) makes its kernel reset the connection, and the reset
    # can discard the goodbye before the peer reads it: the peer would report a lost process.
    # So this process waits (up to 2 s) for each peer to close the connection in answer, its
    # listener reading everything that arrives until then.
    if not _watch:
        return
    _watch["leaving"] = True
    peers, _watch["peers"] = dict(_watch.get("peers", {})), {}
    for conn in peers.values():
        try:
            conn.sendall(BYE)
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    while set(peers) - _watch["closed"] and time.monotonic() < deadline:
        time.sleep(0.01)


def lost_peer(wait: float) -> tuple | None:
    """(process, why) of the lost process that the watchdog found, waiting up to `wait` s."""
    deadline = time.monotonic() + wait
    while "lost" not in _watch and _watch and time.monotonic() < deadline:
        time.sleep(0.05)
    return _watch.get("lost")


def make_mesh(d: int, t: int, c: int = 1, devices=None) -> jax.sharding.Mesh:
    """The (d, c, t) mesh over `devices` (default: all, of every process): t innermost (its
    collectives are the most frequent), then the ring c. Auto axes: arrays are placed with the
    NamedShardings derived from their annotations, so no explicit-sharding types are needed."""
    return jax.make_mesh((d, c, t), ("d", "c", "t"), axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def run_program(program):
    """Runs `program()`, the whole of a command that may be one of several processes: SIGTERM stops
    it with one line until its training loop takes SIGTERM over; a SeqaxError is printed as one line
    (process 0 stops the others with a line first) and exits 2; a lost peer is named in one line."""
    exit_on_sigterm()
    try:
        program()
        leave()  # the other processes' watchdogs take this exit for a finish, not a death
    except SeqaxError as e:
        print(f"{console_name()}: error: {e}", file=sys.stderr, flush=True)
        leave(error=True)
        sys.exit(2)
    except jax.errors.JaxRuntimeError as e:
        exit_if_peer_lost(e)  # several processes: one line naming the likely cause, then exit
        raise
