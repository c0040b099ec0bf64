"""One writer per run directory (docs/design.md): a run holds an OS file lock on `<run>/.lock`.

The lock is fcntl.flock on an open file: the kernel releases it when the holder closes the file
or dies, however it dies (SIGKILL included), so a lock is never stale and nothing needs
cleaning up. The file holds the holder's pid and host, for the line a second run prints; it
stays after the run, and an unlocked file means nothing. In a multi-process run process 0 takes
the lock and the others wait until it holds. Readers (sample.py, the export) take no lock.
"""

import contextlib
import fcntl
import os
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

from seqax.config import ConfigError

LOCK_FILE = ".lock"


def _take(run_dir: str) -> int:
    """This process locks `run_dir` (creating it); a held lock is a ConfigError naming its holder.
    Returns the locked file descriptor; closing it releases the lock."""
    os.makedirs(run_dir, exist_ok=True)
    # no truncation: the holder's line stays
    fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process starting up"
        os.close(fd)
        raise ConfigError(f"run directory {run_dir!r} is in use by a live run ({holder}); "
                          "wait for it to end, or choose another paths.model_name") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def hold(run_dir: str):
    """Holds the lock of `run_dir` for the block (process 0; the others wait until it holds)."""
    fd, error = None, None
    if jax.process_index() == 0:
        try:
            fd = _take(run_dir)
        except ConfigError as e:
            error = e
    if jax.process_count() > 1 and not np.all(multihost_utils.process_allgather(np.array([error is None]))):
        raise error or ConfigError(f"process 0 could not lock the run directory {run_dir!r}; its line says why")
    if error is not None:
        raise error
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
