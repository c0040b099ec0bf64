"""Losing a process of a multi-process run (multihost.py's watchdog, tools/launch_local.py): whichever
process dies, the others exit 1 within the heartbeat timeout with one line naming it, and the
launcher names the dead one; a process that never joins is named too; SIGTERM before the training
loop ends a run with one line (train.py), and so does a Ctrl-C. Real processes on 127.0.0.1."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from fixtures import TINY, synthetic_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_S = 10
ARGS = [a for a in TINY if not a.startswith(("model.n_kv", "training.steps", "+paths.model_name"))] + [
    "model.n_kv=2", "eval_batches=0", "checkpoint_interval=0", "training.steps=100000",
    f"distributed.heartbeat_timeout_seconds={HEARTBEAT_S}"]
NATIVE = ("Check failure stack trace", "Terminating process because", "Fatal Python error", "Traceback")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("peer_loss") / "data.zarr", "--train-tokens", "100000",
                             "--validation-tokens", "10000")


def environment(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path.parent / "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


class Launch:
    """tools.launch_local on 2 x 4 devices, its output read line by line."""

    def __init__(self, tmp_path, dataset, *args):
        command = [sys.executable, "-m", "tools.launch_local", "--processes", "2", "--devices-per-process", "4",
                   "--grace-seconds", "60", "--",
                   "--config-name=local_test_synthetic", "+paths.model_name=run", f"paths.root_working_dir={tmp_path}",
                   f"dataset.path={dataset}", *ARGS, *args]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=environment(tmp_path), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines, self.stepped = [], threading.Event()
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("[0] step"):
                self.stepped.set()
        self.stepped.set()  # the launcher has exited: stop waiting

    def pids(self) -> dict[int, int]:
        return {int(l.split()[2]): int(l.split()[-1]) for l in self.lines
                if l.startswith("launch_local: process ") and " has pid " in l}

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.reader.join(timeout=10)

    def of(self, i: int) -> list[str]:
        return [l[len(f"[{i}] "):] for l in self.lines if l.startswith(f"[{i}] ")]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_killing_either_process_stops_the_other_with_one_line(tmp_path, dataset, killed):
    launch = Launch(tmp_path, dataset)
    assert launch.stepped.wait(timeout=300) and launch.proc.poll() is None, "".join(launch.lines[-40:])
    os.kill(launch.pids()[killed], signal.SIGKILL)
    killed_at = time.monotonic()
    status = launch.finish(timeout=120)
    survivor = 1 - killed
    exited = time.monotonic() - killed_at
    print(f"killed process {killed}: the launcher exited {exited:.2f} s later")
    assert exited < HEARTBEAT_S, "".join(launch.lines[-40:])
    # Ours is the one line of seqax; when the coordinator dies, JAX's runtime may log a few lines of
    # its own first (docs/multi-host.md), but the watchdog exits before its abort prints a stack.
    ours = [l for l in launch.of(survivor) if l.startswith("seqax") and ": error: " in l]
    sign = "seqax" if survivor == 0 else f"seqax[process {survivor}]"
    assert len(ours) == 1 and ours[0].startswith(f"{sign}: error: lost process {killed} ("), "".join(launch.lines[-40:])
    assert not any(n in l for l in launch.of(survivor) for n in NATIVE
                   if n != "Terminating process because"), "".join(launch.lines[-40:])
    if killed == 1:  # process 0 learns first, from its own watchdog: nothing from the runtime
        assert not any("Terminating process because" in l for l in launch.of(survivor)), "".join(launch.lines[-40:])
    assert (f"launch_local: process {killed} (pid {launch.pids()[killed]}) was killed by SIGKILL first; "
            "exiting with status 137\n") in launch.lines
    assert status == 137


@pytest.mark.slow
def test_a_process_that_never_joins_is_named(tmp_path, dataset):
    """Only process 0 starts (process 1 of 2 never comes): it names process 1 after the initialization timeout."""
    env = {**environment(tmp_path), "JAX_COORDINATOR_ADDRESS": "127.0.0.1:0", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "0"}
    port = free_port_pair()
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "train", "--config-name=local_test_synthetic",
                             "+paths.model_name=alone", f"paths.root_working_dir={tmp_path}",
                             f"dataset.path={dataset}", *ARGS, "distributed.initialization_timeout_seconds=5"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "seqax: error: process(es) [1] did not join within 5 s"), result.stderr[-3000:]
    assert not any(n in result.stderr for n in NATIVE) and took < 60, (took, result.stderr[-3000:])


def free_port_pair() -> int:
    from tools.launch_local import free_port
    return free_port()


@pytest.mark.slow
@pytest.mark.parametrize("when", ["importing", "compiling"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_before_the_loop_exits_with_one_line(tmp_path, dataset, when, signum):
    """SIGTERM, or a Ctrl-C (SIGINT; was: a KeyboardInterrupt traceback)."""
    env = {**environment(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.Popen([sys.executable, "-m", "train", "--config-name=local_test_synthetic",
                             "+paths.model_name=early", f"paths.root_working_dir={tmp_path}",
                             f"dataset.path={dataset}", *ARGS],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if when == "importing":
        time.sleep(0.5)
    else:  # config.yaml is written just before the step is compiled
        while not os.path.exists(tmp_path / "early" / "config.yaml") and proc.poll() is None:
            time.sleep(0.05)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-3000:]
    name = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}[signum]
    assert err.strip().splitlines() == [
        f"seqax: error: stopped by {name} before the training loop, with no step to save; "
        "a restart resumes from the newest checkpoint"], err[-3000:]
    assert re.search(r"^step +\d+/", out, re.M) is None, out  # no step ran (the peak's source may name one)


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_0(tmp_path, dataset):
    """Every process saves at an agreed step, says goodbye (no `lost process` line) and exits 0:
    so does the launcher."""
    launch = Launch(tmp_path, dataset)
    assert launch.stepped.wait(timeout=300) and launch.proc.poll() is None, "".join(launch.lines[-40:])
    launch.proc.send_signal(signal.SIGTERM)
    status = launch.finish(timeout=180)
    assert status == 0, "".join(launch.lines[-40:])
    assert ("launch_local: all 2 processes exited 0\n" in launch.lines
            and not any("error" in l for l in launch.lines)), "".join(launch.lines[-40:])
    assert any(n.isdigit() for n in os.listdir(tmp_path / "run" / "checkpoints"))


def test_the_launcher_blames_the_first_failure_or_the_one_its_peers_report_lost():
    from tools.launch_local import Launcher, shell_status
    launcher = Launcher.__new__(Launcher)  # no processes: only the bookkeeping
    launcher.lock = threading.Lock()
    launcher.exited, launcher.blamed = {0: (10.0, 0), 1: (10.5, 0)}, {}
    assert launcher.first_failure() is None
    launcher.exited = {0: (10.0, 1), 1: (10.2, 2)}
    assert launcher.first_failure() == (0, 1)
    # Process 0's watchdog exited 1 a few milliseconds before the launcher saw process 1's death.
    launcher.exited, launcher.blamed = {0: (10.000, 1), 1: (10.004, -signal.SIGKILL)}, {0: 1}
    assert launcher.first_failure() == (1, -signal.SIGKILL) and shell_status(-signal.SIGKILL) == 137
