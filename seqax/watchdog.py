"""The liveness watchdog of a multi-process run.

JAX's runtime ends a process natively (SIGABRT and a C++ stack) when it finds a peer gone: at
once when the coordinator dies, after the heartbeat timeout for another process, and when a
peer never joins. So that the user sees one line instead, every process also holds a TCP
connection of its own to process 0 (the coordinator's host, its port + 1), over which both
sides send a byte every few seconds. A closed or silent connection means a lost process: the
watchdog prints one line naming it and exits 1 before the runtime's abort fires. Process 0
passes the news on to the others, so every process names the one that died first.
"""

import os
import socket
import sys
import threading
import time

from seqax.console import signature

LIVENESS_PORT_OFFSET = 1  # process 0's liveness server listens on the coordinator's port + this
# a heartbeat; "I exit on purpose"; "L<j>\n": process j was lost; "process 0 stops with an error"
BEAT, BYE, LOST, ERROR = b".", b"B", b"L", b"E"
_watch: dict = {}
_stopping = threading.Lock()


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


def stop(process_id: int, line: str, notice: bytes = ERROR):
    """Prints `line` signed by this process and exits 1; process 0 first tells the others (`notice`).
    Only the first caller prints."""
    if _stopping.acquire(blocking=False):
        os.write(2, f"{signature(process_id)}: error: {line}\n".encode(errors="replace"))
        if process_id == 0 and "closed" in _watch:
            _tell_others(notice, wait=2.0)
        os._exit(1)  # not sys.exit: jax.distributed's shutdown would wait for the dead process
    threading.Event().wait()  # another thread is exiting the process


def stop_for_lost_peer(process_id: int, peer: int, why: str):
    _watch.setdefault("lost", (peer, why))
    stop(process_id, f"lost process {peer} ({why}); stopping this process too "
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
            stop_for_lost_peer(process_id, peer,
                               f"no heartbeat for {timeout:.0f} s: its host may be down or unreachable")
        except OSError:
            data = b""
        if not data:
            _watch["closed"].add(peer)
            if _watch.get("leaving"):  # this process is exiting on purpose: the peer closed in answer to its goodbye
                return
        if ERROR in data:
            stop_for_lost_peer(process_id, 0, "it stopped with an error: see its line")
        if BYE in data:
            _watch["peers"].pop(peer, None)
            conn.close()  # the answer to a goodbye: the leaving process waits for it (leave)
            return
        if LOST in data:
            reported = data[data.index(LOST) + 1:].split(b"\n")[0]
            stop_for_lost_peer(process_id, int(reported) if reported.isdigit() else 0, "process 0 reports it gone")
        if not data:
            stop_for_lost_peer(process_id, peer, "its connection closed: it exited or was killed")


def _serve(process_id: int, num: int, server: socket.socket, timeout: float, join_timeout: float):
    """Process 0: accepts one connection from every other process, then watches each."""
    server.settimeout(1.0)
    deadline = time.monotonic() + join_timeout
    while len(_watch["peers"]) < num - 1:
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, num)) - set(_watch["peers"]))
            stop(process_id, f"process(es) {missing} did not join within {join_timeout:.0f} s "
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
                stop(process_id, f"could not reach process 0 at {host}:{port} within {join_timeout:.0f} s ({e}); "
                                  "check that it started and that this port (the coordinator's + 1) "
                                  "is open between the hosts")
            time.sleep(0.2)


def start(process_id: int, num: int, coordinator: str, timeout: float, join_timeout: float):
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


def process_index() -> int:
    """This process's index in the run, once the watchdog has started (0 before, or alone)."""
    return _watch.get("process", 0)
