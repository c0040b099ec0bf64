"""One writer per run directory (docs/design.md): a run holds an OS file lock on `<run>/.lock`.

The lock is fcntl.flock on an open file: the kernel releases it when the holder closes the file
or dies, however it dies (SIGKILL included), so a lock is never stale and nothing needs
cleaning up. The file holds the holder's pid and host, for the line a second run prints; it
stays after the run, and an unlocked file means nothing. In a multi-process run process 0 takes
the lock and the others wait until it holds. Readers (sample.py, the export) take no lock.

A lock on a file that is no longer `<run>/.lock` (the directory deleted, moved or replaced under the
live run) guards nothing: RunRecords checks at every step that it still is (`check_in_place`), and
the Checkpointer before it reports a failed write (the deletion, not the file it took, is the cause).
"""

import contextlib
import fcntl
import os
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

from seqax.config import ConfigError, OutputError

LOCK_FILE = ".lock"


def _take(run_dir: str) -> int:
    """This process locks `run_dir` (creating it); a held lock is a ConfigError naming its holder, a
    directory it cannot write an OutputError. Returns the locked file descriptor; closing it releases the lock."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no truncation: the holder's line stays
    except OSError as e:
        raise unwritable(e, path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process starting up"
        os.close(fd)
        raise ConfigError(f"run directory {run_dir!r} is in use by a live run ({holder}); "
                          "wait for it to end, or choose another paths.model_name") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise unwritable(e, path) from None
    return fd


def unwritable(error: OSError, path: str) -> OutputError:
    return OutputError(f"cannot write {error.filename or path}: {error.strerror or error}; a run writes its directory "
                       "paths.root_working_dir/paths.model_name: free space or make it writable, or choose another "
                       "paths.root_working_dir")


@contextlib.contextmanager
def hold(run_dir: str):
    """Holds the lock of `run_dir` for the block (process 0; the others wait until it holds)."""
    fd, error = None, None
    if jax.process_index() == 0:
        try:
            fd = _take(run_dir)
        except (ConfigError, OutputError) as e:
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


def path_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of an existing file or directory, else None: the same while it is the same one, another
    once it is deleted and made again."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def lock_identity(run_dir: str) -> tuple[int, int] | None:
    """path_identity of `run_dir`'s lock file, None when it has none."""
    return path_identity(os.path.join(run_dir, LOCK_FILE))


def check_in_place(run_dir: str, identity: tuple[int, int]):
    """An OutputError when `run_dir`'s lock file is no longer the one whose `identity` the run took at its
    start: its directory was deleted, moved or replaced (or the lock file deleted), and the run would go on
    writing files nobody sees while a second run could start beside it."""
    if lock_identity(run_dir) != identity:
        raise OutputError(f"the run directory {run_dir!r} was deleted, moved or replaced while this run was writing "
                          f"it (its {LOCK_FILE} is gone or another); the run stops here and recreates nothing: put "
                          "the directory back (or choose another paths.model_name) and run the same command to resume "
                          "from its newest checkpoint")
