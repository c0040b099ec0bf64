"""Runs one training job as N processes on this machine, each with K simulated CPU devices,
joined by JAX's distributed runtime on 127.0.0.1 (CPU collectives): the multi-host code paths
without a cluster.

    python -m tools.launch_local --processes 2 --devices-per-process 4 -- \
        --config-name=local_test_synthetic +paths.model_name=RUN mesh.d=4 mesh.t=2

Each line a process prints comes out prefixed with `[i]`. If a process fails (non-zero status or
a signal), the others stop on their own (each names the lost process; multihost.py) or are killed
after --grace-seconds; the launcher names the process that failed first and exits with its status
(128 + the signal for a process killed by one). SIGTERM or Ctrl-C is passed on to every process
(a run saves a checkpoint on SIGTERM); the launcher then exits 0 if every process exited 0, and
any still alive after --grace-seconds are killed. No process outlives the launcher: on Linux each is
also killed by the kernel when the launcher dies, even by SIGKILL (its output, the launcher's, is gone
then; a restart resumes from the newest committed checkpoint).
"""

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOST = re.compile(r"error: lost process (\d+) ")  # multihost.py's line when a peer is gone


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that started it ends


def session_ending_with(launcher: int):
    """A Popen preexec_fn: the child in a session of its own (stopping it stops what it started), killed
    by the kernel when the launcher (pid `launcher`) dies, so that a SIGKILLed launcher leaves no worker
    running (they would wait for the distributed runtime's heartbeat timeout, half a minute, unseen)."""
    def start():
        os.setsid()
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != launcher:  # the launcher died before the line above
                os._exit(1)
    return start


def free_port() -> int:
    """A free port whose successor is free too: multihost.py's watchdog listens on the coordinator's port + 1."""
    while True:
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            try:
                t.bind(("127.0.0.1", s.getsockname()[1] + 1))
            except OSError:
                continue
            return s.getsockname()[1]


def process_env(i: int, n: int, devices: int, port: int) -> dict:
    """Process i's environment: K CPU devices (the XLA flag goes before any other), and the
    coordinator's address, the process count and this process's index (multihost.py reads them)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {**os.environ, "XLA_FLAGS": " ".join([f"--xla_force_host_platform_device_count={devices}", *flags]),
            "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(i), "PYTHONUNBUFFERED": "1"}


def describe(status: int) -> str:
    return f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"


def shell_status(status: int) -> int:
    """A child's status as a shell reports it: 128 + the signal for one killed by a signal."""
    return 128 - status if status < 0 else status


class Launcher:
    def __init__(self, n: int, devices: int, train_args: list[str], grace: float, port: int):
        self.grace, self.lock = grace, threading.Lock()
        self.port = port or free_port()
        self.log(f"starting {n} processes x {devices} CPU devices, coordinator 127.0.0.1:{self.port}")
        self.procs = []
        for i in range(n):
            proc = subprocess.Popen([sys.executable, "-m", "train", *train_args], cwd=ROOT,
                                    env=process_env(i, n, devices, self.port), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, preexec_fn=session_ending_with(os.getpid()))
            self.procs.append(proc)
            self.log(f"process {i} has pid {proc.pid}")
        self.exited = {}  # process -> (time.monotonic() of its exit, status), in the order they exited
        self.blamed = {}  # process -> the process it reported lost (`error: lost process j`)
        self.readers = [threading.Thread(target=self.stream, args=(i, p), daemon=True)
                        for i, p in enumerate(self.procs)]
        for reader in self.readers:
            reader.start()
        self.reapers = [threading.Thread(target=self.reap, args=(i, p), daemon=True) for i, p in enumerate(self.procs)]
        for reaper in self.reapers:
            reaper.start()

    def log(self, text: str):
        with self.lock:
            print(f"launch_local: {text}", flush=True)

    def reap(self, i: int, proc: subprocess.Popen):
        status = proc.wait()
        with self.lock:
            self.exited[i] = (time.monotonic(), status)

    def stream(self, i: int, proc: subprocess.Popen):
        for line in iter(proc.stdout.readline, b""):
            lost = LOST.search(line.decode(errors="replace"))
            if lost:
                self.blamed.setdefault(i, int(lost.group(1)))
            with self.lock:
                sys.stdout.write(f"[{i}] {line.decode(errors='replace')}")
                sys.stdout.flush()

    def signal_all(self, sig: int):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, sig: int) -> None:
        """Sends `sig` to every live process, then SIGKILL to any left after the grace period."""
        self.signal_all(sig)
        deadline = time.monotonic() + (self.grace if sig != signal.SIGKILL else 0)
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for reader in self.readers:
            reader.join(timeout=5)

    def first_failure(self) -> tuple[int, int] | None:
        """(process, status) of the process that failed first: the earliest non-zero exit, unless
        the processes that failed with it (within a second) all report it lost (multihost.py) another
        failed one: a survivor's watchdog may exit within milliseconds of the death it reports."""
        with self.lock:
            failed = sorted((t, i, s) for i, (t, s) in self.exited.items() if s != 0)
        if not failed:
            return None
        t, i, status = failed[0]
        reported = self.blamed.get(i)
        if reported is not None and reported != i and any(j == reported and u - t < 1.0 for u, j, _ in failed):
            return reported, self.exited[reported][1]
        return i, status

    def wait_all(self, grace: float) -> None:
        """Waits up to `grace` s for every process to exit on its own, then kills what is left."""
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop(signal.SIGKILL)

    def outcome(self) -> int:
        for reaper in self.reapers:  # every process has exited: their exit times are being recorded
            reaper.join()
        failure = self.first_failure()
        if failure is None:
            self.log(f"all {len(self.procs)} processes exited 0")
            return 0
        i, status = failure
        self.log(f"process {i} (pid {self.procs[i].pid}) {describe(status)} first; "
                 f"exiting with status {shell_status(status)}")
        return shell_status(status) or 1

    def run(self) -> int:
        """Waits for every process. After the first failure the others get --grace-seconds to stop
        on their own (naming the lost process), then are killed. Returns the exit status."""
        stopping = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stopping.append(signum))
        first_done = None
        try:
            while True:
                if stopping:
                    self.log(f"received {signal.Signals(stopping[0]).name}: passing SIGTERM to every process")
                    self.stop(signal.SIGTERM)
                    return self.outcome()
                statuses = [p.poll() for p in self.procs]
                failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
                if failed:
                    i, status = failed[0]
                    self.log(f"process {i} (pid {self.procs[i].pid}) {describe(status)}; "
                             f"waiting up to {self.grace:.0f} s for the others to stop")
                    self.wait_all(self.grace)
                    return self.outcome()
                if all(s == 0 for s in statuses):
                    for reader in self.readers:
                        reader.join(timeout=5)
                    return self.outcome()
                if first_done is None and 0 in statuses:
                    first_done = time.monotonic()
                if first_done is not None and time.monotonic() - first_done > self.grace + 60:
                    waiting = [i for i, s in enumerate(statuses) if s is None]
                    self.log(f"processes {waiting} still running 60 s after process {statuses.index(0)} finished; "
                             "stopping them")
                    self.stop(signal.SIGKILL)
                    return 1
                time.sleep(0.05)
        finally:
            self.signal_all(signal.SIGKILL)  # nothing outlives the launcher, whatever happened


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m tools.launch_local --processes N --devices-per-process K -- TRAIN_ARGS...")
    parser.add_argument("--processes", type=int, required=True, help="processes to start (N)")
    parser.add_argument("--devices-per-process", type=int, required=True,
                        help="simulated CPU devices of each process (K)")
    parser.add_argument("--port", type=int, default=0, help="the coordinator's port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--grace-seconds", type=float, default=30.0,
                        help="after SIGTERM, how long processes may take to save and exit;\n"
                             "after a failure, how long the others may take to stop on their own")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments of `python -m train`, after --")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be positive")
    return Launcher(args.processes, args.devices_per_process, train_args, args.grace_seconds, args.port).run()


if __name__ == "__main__":
    sys.exit(main())
