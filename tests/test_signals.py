"""signals.py: Ctrl-C (SIGINT) sent to a real `python -m train`. In the loop the first one saves a
checkpoint after the step and exits 0, as SIGTERM does, with one process or several; a second one
stops the run at once with one line and leaves nothing on disk that a restart cannot resume from.
(SIGTERM and SIGINT before the loop: tests/test_peer_loss.py.)"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fixtures import ROOT, TINY, start_train, synthetic_dataset, tiny_overrides, train_args
from seqax import signals
from tools.launch_local import free_port, process_env


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("signals") / "data.zarr", "--train-tokens", "100000",
                             "--validation-tokens", "10000")


class Run:
    """A `python -m train` child whose stdout and stderr are read line by line as they come."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.out, self.err = process, [], []
        self.readers = [threading.Thread(target=self.read, args=(stream, lines), daemon=True)
                        for stream, lines in ((process.stdout, self.out), (process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def read(stream, lines: list):
        for line in stream:
            lines.append(line)

    def wait_for(self, prefix: str, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while not any(line.startswith(prefix) for line in self.out):
            assert self.process.poll() is None, f"the run ended before {prefix!r}: {''.join(self.err)[-3000:]}"
            assert time.monotonic() < deadline, f"no {prefix!r} within {timeout} s"
            time.sleep(0.01)

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            for reader in self.readers:
                reader.join(timeout=10)

    def errors(self) -> list[str]:
        """stderr without warnings (graphviz's absence: fixtures.child_env)."""
        return [line.rstrip("\n") for line in self.err if not line.startswith("seqax: warning: ")]


def start(root, dataset: str, name: str, *overrides: str, devices: int = 8) -> Run:
    args = train_args(root, dataset, name, *tiny_overrides(*overrides))
    return Run(start_train(args, devices=devices, cache=root.parent / "jax_cache", graph=False,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def step_lines(run_dir) -> list[dict]:
    return [line for line in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in line]


def committed(run_dir) -> list[int]:
    steps = []
    for name in sorted(os.listdir(run_dir / "checkpoints")):
        with open(run_dir / "checkpoints" / name / "zarr.json") as f:
            if json.load(f)["attributes"]["write_completed"] is True:
                steps.append(int(name))
    return steps


@pytest.mark.slow
def test_ctrl_c_in_the_loop_saves_a_checkpoint_and_exits_0(tmp_path, dataset):
    """Was: a 60-line KeyboardInterrupt traceback, exit 130, and the steps since the last checkpoint lost."""
    run = start(tmp_path, dataset, "run", "training.steps=100000", "checkpoint_interval=0", "eval_batches=0")
    run.wait_for("step      3/")
    interrupted = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    assert run.finish() == 0, "".join(run.err)[-3000:]
    print(f"Ctrl-C to exit: {time.monotonic() - interrupted:.2f} s")
    done = step_lines(tmp_path / "run")[-1]["step"] + 1
    assert run.errors() == [f"seqax: stopped by Ctrl-C (a second one stops at once, without saving): checkpoint "
                            f"{done} is being written; exiting"]
    assert committed(tmp_path / "run") == [done]
    resumed = start(tmp_path, dataset, "run", f"training.steps={done + 2}", "checkpoint_interval=0", "eval_batches=0")
    assert resumed.finish(timeout=300) == 0, "".join(resumed.err)[-3000:]
    assert [line["step"] for line in step_lines(tmp_path / "run")[-2:]] == [done, done + 1]


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_a_restart_resumes(tmp_path, dataset):
    """Both Ctrl-Cs arrive during an evaluation (300 batches: seconds), after which the loop would
    save: the second one stops the run there, exit 130. The checkpoints on disk are whole (an
    interrupted one is deleted at the restart), and the restart finishes the run."""
    overrides = ["checkpoint_interval=2", "checkpoints.keep=0", "eval_interval=5", "eval_batches=300"]
    run = start(tmp_path, dataset, "run", "training.steps=100000", *overrides)
    run.wait_for("step      4/")  # the line that the evaluation after step 4 writes first
    run.process.send_signal(signal.SIGINT)
    time.sleep(0.5)  # Python runs the first handler before the second signal arrives: two, not one
    interrupted = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    assert run.finish() == 130, "".join(run.err)[-3000:]
    print(f"second Ctrl-C to exit: {time.monotonic() - interrupted:.2f} s")
    assert run.errors() == ["seqax: error: stopped by a second Ctrl-C (SIGINT), without saving the steps since the "
                            "newest checkpoint; a restart resumes from it"]
    assert not any("eval " in line for line in run.out)  # stopped inside the evaluation
    restart = start(tmp_path, dataset, "run", "training.steps=6", *overrides)
    assert restart.finish(timeout=300) == 0 and not restart.errors(), "".join(restart.err)[-3000:]
    assert {line["step"] for line in step_lines(tmp_path / "run")} == set(range(6))
    assert committed(tmp_path / "run") == [2, 4, 6]


@pytest.mark.slow
def test_sigterm_during_the_last_evaluation_says_the_run_is_complete(tmp_path, dataset):
    """SIGTERM after the last step's checkpoint, while the final evaluation (300 batches: seconds) runs:
    the evaluation finishes, the run exits 0 and says why it did not stop at once (was: no line)."""
    run = start(tmp_path, dataset, "run", "training.steps=6", "checkpoint_interval=0", "eval_interval=0",
                "eval_batches=300")
    run.wait_for("step      5/")  # the last step's line, written before its checkpoint and the evaluation
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=300) == 0, "".join(run.err)[-3000:]
    assert run.errors() == ["seqax: preempted during the last evaluation: the run is complete at step 6 (its "
                            "checkpoint committed)"]
    assert committed(tmp_path / "run") == [6] and any("eval " in line for line in run.out)


@pytest.mark.slow
def test_ctrl_c_to_every_process_of_a_run_saves_on_each_and_exits_0(tmp_path, dataset):
    """Two processes of one jax.distributed run, each sent SIGINT (as a terminal's Ctrl-C reaches a
    process group, or srun passes it on): JAX's preemption service, given it as a SIGTERM, has them
    agree on a step; both save it and exit 0."""
    port, cache = free_port(), tmp_path.parent / "jax_cache"
    overrides = [a for a in TINY if not a.startswith(("model.n_kv", "training.steps"))]
    args = train_args(tmp_path, dataset, "run", *overrides, "model.n_kv=2", "training.steps=100000",
                      "checkpoint_interval=0", "eval_batches=0")
    runs = []
    for i in range(2):
        env = {**process_env(i, 2, 4, port), "JAX_COMPILATION_CACHE_DIR": str(cache),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        runs.append(Run(subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    try:
        runs[0].wait_for("step      3/")
        for run in runs:
            run.process.send_signal(signal.SIGINT)
    finally:
        statuses = [run.finish(timeout=180) for run in runs]
    assert statuses == [0, 0], [("".join(run.err))[-2000:] for run in runs]
    done = step_lines(tmp_path / "run")[-1]["step"] + 1
    for i, run in enumerate(runs):
        ours = [line for line in run.errors() if line.startswith("seqax")]
        sign = "seqax" if i == 0 else "seqax[process 1]"
        assert ours == [f"{sign}: stopped by Ctrl-C (a second one stops at once, without saving): checkpoint {done} "
                        "is being written; exiting"], run.err
    assert committed(tmp_path / "run") == [done]


def test_two_ctrl_c_that_python_handles_as_one_still_stop_the_run(monkeypatch):
    """Two Ctrl-C that arrive while the main thread is inside one call (a step on the device) get one call of
    Python's handler; they are two presses all the same, and the second stops the run. Here the call is a
    large matmul in NumPy (measured to outlast both presses) and the presses come from another thread."""
    stopped = []
    monkeypatch.setattr(signals, "stop_now", lambda signature, line, signum: stopped.append((line, signum)))
    a = np.ones((3000, 3000))

    def press_twice():
        time.sleep(0.02)  # the main thread is inside the matmul by now
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    with signals.PreemptionWatch() as watch:
        presser = threading.Thread(target=press_twice)
        started = time.monotonic()
        presser.start()
        a @ a  # noqa: B018 (one C call: no Python handler runs until it returns)
        inside = time.monotonic() - started
        presser.join()
    assert inside > 0.1, f"the matmul took {inside:.3f} s, less than the presses' 0.07 s: use a larger one"
    assert watch.interrupts == 2 and len(stopped) == 1, (watch.interrupts, stopped)
    assert "second Ctrl-C" in stopped[0][0] and stopped[0][1] == signal.SIGINT
