"""One writer per run directory (run_lock.py): a second run on a live run's directory stops at
once with one line naming it, and changes nothing; the lock dies with its holder."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from fixtures import child_env, snapshot, synthetic_dataset
from seqax import run_lock
from seqax.config import ConfigError, OutputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.d_model=64", "model.n_kv=2", "model.d_head=16", "model.d_ff=128", "model.layers=1",
         "training.tokens.batch=8", "training.steps=12", "checkpoint_interval=4", "eval_batches=0"]



def start_train(root, name: str, dataset: str, *overrides: str) -> subprocess.Popen:
    env = child_env(8, graph=False)  # nothing here reads training_step.svg
    cmd = [sys.executable, "-m", "train", "--config-name=local_test_synthetic", f"+paths.model_name={name}",
           f"paths.root_working_dir={root}", f"dataset.path={dataset}", *SMALL, *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """The synthetic tasks at a two-hundredth of the default size: 12 steps read 6144 tokens."""
    return synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic.zarr", "--train-tokens", "20000",
                             "--validation-tokens", "3000")


def losses(run_dir) -> list[tuple[int, float]]:
    return [(l["step"], l["loss"]) for l in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
            if "loss" in l]


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path):
    run_dir = str(tmp_path / "run")
    with run_lock.hold(run_dir):
        with pytest.raises(ConfigError, match=rf"run directory '{run_dir}' is in use by a live run "
                                              rf"\(pid {os.getpid()} on host {socket.gethostname()}\)"):
            with run_lock.hold(run_dir):
                pass
    with run_lock.hold(run_dir):  # released on exit
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    run_dir = str(tmp_path / "run")
    script = (f"import time\nfrom seqax import run_lock\nwith run_lock.hold({run_dir!r}):\n"
              "    print('held', flush=True)\n    time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(ConfigError, match=f"pid {holder.pid} on host"):
        with run_lock.hold(run_dir):
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with run_lock.hold(run_dir):
        pass


@pytest.mark.slow
def test_a_second_run_stops_at_once_and_the_first_finishes_undisturbed(dataset, tmp_path):
    reference = start_train(tmp_path, "reference", dataset)
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-3000:]
    first = start_train(tmp_path, "run", dataset)
    lock = tmp_path / "run" / run_lock.LOCK_FILE
    try:
        deadline = time.monotonic() + 300
        while not (lock.exists() and lock.read_text().startswith(f"pid {first.pid} ")):
            assert first.poll() is None and time.monotonic() < deadline, (
                first.stderr.read()[-3000:] if first.poll() is not None else "no lock")
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # keeps it alive, holding the lock, however fast it trains
        before = snapshot(tmp_path / "run")
        began = time.monotonic()
        second = start_train(tmp_path, "run", dataset)
        _, stderr = second.communicate(timeout=120)
        elapsed = time.monotonic() - began
        assert snapshot(tmp_path / "run") == before
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2 and elapsed < 60
    holder = f"pid {first.pid} on host {socket.gethostname()}"
    line = (f"seqax: error: run directory '{tmp_path / 'run'}' is in use by a live run ({holder}); "
            "wait for it to end, or choose another paths.model_name")
    assert stderr.splitlines() == [line]
    assert first.wait(timeout=600) == 0, first.stderr.read()[-3000:]
    assert (losses(tmp_path / "run") == losses(tmp_path / "reference")
            and [s for s, _ in losses(tmp_path / "run")] == list(range(12)))
    assert (sorted(os.listdir(tmp_path / "run" / "checkpoints"))
            == sorted(os.listdir(tmp_path / "reference" / "checkpoints"))
            == ["0000000004", "0000000008", "0000000012"])


def test_a_lock_whose_file_was_deleted_or_replaced_is_no_longer_in_place(tmp_path):
    run_dir = str(tmp_path / "run")
    with run_lock.hold(run_dir):
        identity = run_lock.lock_identity(run_dir)
        run_lock.check_in_place(run_dir, identity)
        os.rename(run_dir, str(tmp_path / "moved"))
        os.makedirs(os.path.join(run_dir))
        with open(os.path.join(run_dir, run_lock.LOCK_FILE), "w"):
            pass  # a new directory, a new lock file: another inode
        with pytest.raises(OutputError, match=rf"^the run directory '{run_dir}' was deleted, moved or replaced"):
            run_lock.check_in_place(run_dir, identity)


@pytest.mark.slow
def test_a_run_directory_deleted_under_a_live_run_stops_it_with_one_line_and_stays_deleted(dataset, tmp_path):
    """The run directory removed (rm -rf) while the run trains, after its first checkpoint: one line at the next
    step or save, exit 2, and nothing under it recreated (it went on writing a deleted metrics.jsonl, exit 0, and
    checkpoints reappeared in a directory without config, metrics or lock)."""
    run = start_train(tmp_path, "run", dataset, "training.steps=100000", "checkpoint_interval=5")
    run_dir = tmp_path / "run"
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "0000000005").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
            time.sleep(0.1)
        while run_dir.exists():  # the run writes while it is removed: rmtree again until it is gone
            shutil.rmtree(run_dir, ignore_errors=True)
        _, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if not line.startswith("seqax: warning: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"seqax: error: the run directory '{run_dir}' was deleted, moved or replaced while this run was writing it"), (
        errors)
    assert not run_dir.exists()
