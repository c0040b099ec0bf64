"""Multi-host training with real processes on 127.0.0.1 (tools/launch_local.py, multihost.py):
2 processes give the losses of 1, checkpoints move between process counts, and a dead process
stops the launch. That process i assembles exactly its rows of the global batch is
tests/test_data_loader.py::test_two_processes_assemble_the_same_batch."""

import contextlib
import email
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from fixtures import ROOT, child_env, prepared_dataset, run_train, tiny_overrides, train_args
from seqax.config import ConfigError, DistributedConfig
from seqax.multihost import resolve

# TINY with 2 kv heads (so that t=2 splits them) and a warmup longer than every run here, so the
# learning rate of a step does not depend on training.steps and runs of 3 and 4 steps agree.
OVERRIDES = ["model.n_kv=2", "training.warmup_steps=10", "eval_batches=0", "checkpoint_interval=3",
             "checkpoints.keep=0", "model.vocab=264"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(a bytes dataset, the folder of the compilation cache that every run here shares, a
    multiple-choice task of examples that fit the tiny model's rows of 16 bytes)."""
    root = tmp_path_factory.mktemp("multihost")
    dataset = prepared_dataset(root / "data.zarr", os.path.dirname(email.__file__), "--suffixes", ".py",
                               "--validation-documents", "3")
    rng = random.Random(0)
    words = ["a", "b", "if", "x", "=", "1", "(", ")", ":"]
    with open(root / "short.jsonl", "w") as f:
        for _ in range(20):
            choices = ["".join(rng.choices(words, k=rng.randint(1, 3))) for _ in range(3)]
            f.write(json.dumps({"context": " ".join(rng.choices(words, k=3)), "choices": choices,
                                "label": rng.randrange(3)}) + "\n")
    return dataset, root / "jax_cache", str(root / "short.jsonl")


def multihost_args(root, dataset, name, steps, *changes) -> list[str]:
    return train_args(root, dataset, name, *tiny_overrides(*OVERRIDES, f"training.steps={steps}", *changes))


# The runs here read no training_step.svg: graph=False spares each the drawing (fixtures.child_env).
def one_process(cache, devices, args) -> None:
    result = run_train(args, devices=devices, cache=cache, timeout=300, graph=False)
    assert result.returncode == 0, result.stderr[-3000:]


def launch(cache, processes, devices, args, **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "tools.launch_local", "--processes", str(processes), "--devices-per-process",
               str(devices), "--", *args]
    return subprocess.Popen(command, cwd=ROOT, env=child_env(None, cache, graph=False), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def losses(run_dir) -> dict[int, float]:
    """The loss of each step, from its last line (a resumed run rewrites no earlier step here)."""
    return {line["step"]: line["loss"] for line in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
            if "loss" in line}


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * abs(b)


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoints_move_between_process_counts(setup, tmp_path):
    dataset, cache, task = setup
    # Evaluation after every step: eval_loss and the task, each process feeding its devices their rows
    # and reading the per-token losses back whole (evaluation.host), compared after step 1: one update
    # of gradients summed in another order apart (step 1's losses agree to 1e-6), 1e-4 as the losses
    # after a checkpoint moved. After step 3, QK-norm's scratch edit had the two 1.3e-4 apart and one
    # of the 20 choices flipped: this tiny model at this rate amplifies the order of sums each step.
    evaluated = ["eval_batches=2", "eval_interval=1", f"evaluation.tasks=[{task}]"]
    # 1 process x 8 devices, mesh 4x2: the reference losses of steps 0-3, checkpoints 3 and 4.
    one_process(cache, 8, multihost_args(tmp_path, dataset, "one", 4, *evaluated))
    expected = losses(tmp_path / "one")
    assert sorted(expected) == [0, 1, 2, 3]

    # 2 processes x 4 devices, the same mesh: the same losses and evaluation; checkpoints 3 and 4 written by both.
    launched = launch(cache, 2, 4, multihost_args(tmp_path, dataset, "two", 4, *evaluated))
    output = launched.communicate(timeout=300)[0]
    assert launched.returncode == 0, output[-3000:]
    two = losses(tmp_path / "two")
    # Step 0, the same weights and rows: the forward's float32 sums in another order (8.6e-8 measured). Steps 1
    # and 2 follow updates of gradients summed across processes in another order, which bfloat16's rounding
    # and Muon amplify: one device with its rows reversed (python -m bench.mesh_agreement --rows-reversed:
    # the same math, sums reordered) moves them by up to 2.6e-5 (docs/moe.md), QK-norm's scratch edit
    # these two processes by 1.0e-5; so 1e-4, as test_optimizer's meshes.
    assert sorted(two) == [0, 1, 2, 3] and close(two[0], expected[0], 1e-6), (two, expected)
    assert all(close(two[s], expected[s], 1e-4) for s in (1, 2)), (two, expected)
    one_eval, two_eval = (next(line for line in map(json.loads, open(tmp_path / name / "metrics.jsonl"))
                               if line.get("step") == 1 and "eval_loss" in line) for name in ("one", "two"))
    assert close(two_eval["eval_loss"], one_eval["eval_loss"], 1e-4), (one_eval, two_eval)
    assert two_eval["short/acc"] == one_eval["short/acc"] and two_eval["short/acc_norm"] == one_eval["short/acc_norm"]
    assert "[0] step      2/4" in output and "[1] step" not in output  # only process 0 logs steps
    # embed is V/t M/d: ...
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints" / "0000000003" / "weights.embed" / "c")) == ["0"]
    # ... a chunk file per process along d (rows of the 4x2 mesh: 2 per process).
    assert len(os.listdir(tmp_path / "two" / "checkpoints" / "0000000003" / "weights.embed" / "c" / "0")) == 2

    # The 2-process checkpoint 3 in 1 process on mesh 1x1: step 3 again, from the same state, gives the
    # loss the 2 processes computed, to the forward pass's float32 rounding on another mesh (1e-5, as
    # step 0's). Not the one-process run's step 3: after three Muon updates the two runs' states
    # differ by cross-process sums' rounding, amplified (1.2e-4 in its loss on an AMD EPYC, 2026-12-03).
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "0000000004")
    one_process(cache, 1, multihost_args(tmp_path, dataset, "two", 4, "mesh.d=1", "mesh.t=1"))
    assert close(losses(tmp_path / "two")[3], two[3], 1e-5), (losses(tmp_path / "two"), two)

    # The 1-process checkpoint 3 in 2 processes.
    os.makedirs(tmp_path / "from_one" / "checkpoints")
    shutil.copytree(tmp_path / "one" / "checkpoints" / "0000000003",
                    tmp_path / "from_one" / "checkpoints" / "0000000003")
    launched = launch(cache, 2, 4, multihost_args(tmp_path, dataset, "from_one", 4))
    output = launched.communicate(timeout=300)[0]
    assert launched.returncode == 0, output[-3000:]
    assert sorted(losses(tmp_path / "from_one")) == [3] and close(losses(tmp_path / "from_one")[3], expected[3], 1e-4)


@pytest.mark.slow
def test_a_killed_process_stops_the_launch(setup, tmp_path):
    dataset, cache, _ = setup
    launched = launch(cache, 2, 4, multihost_args(tmp_path, dataset, "killed", 1000, "checkpoint_interval=0"),
                      start_new_session=True)
    lines, stepped = [], threading.Event()

    def read():
        for line in launched.stdout:
            lines.append(line)
            if line.startswith("[0] step"):
                stepped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert stepped.wait(timeout=240), "".join(lines[-50:])
        pids = {int(l.split()[2]): int(l.split()[-1]) for l in lines
                if l.startswith("launch_local: process ") and " has pid " in l}
        port = int(next(l for l in lines if "coordinator 127.0.0.1:" in l).rsplit(":", 1)[1])
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        status = launched.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if launched.poll() is None:
            os.killpg(launched.pid, signal.SIGKILL)
    reader.join(timeout=10)
    print(f"launch_local exited {elapsed:.2f} s after process 1 was killed")
    assert status != 0 and elapsed < 60
    assert any(f"process 1 (pid {pids[1]}) was killed by SIGKILL" in l for l in lines), "".join(lines[-20:])
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # nothing listens on the coordinator's port (connections closed by the kill may linger in TIME_WAIT)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_process_running(setup, tmp_path):
    """SIGKILL to the launcher alone: its processes end with it (the kernel's parent-death signal), where
    they ran on unseen until the distributed runtime's heartbeat timeout (about 32 s) before."""
    dataset, cache, _ = setup
    launched = launch(cache, 2, 4, multihost_args(tmp_path, dataset, "orphans", 1000, "checkpoint_interval=0"),
                      start_new_session=True)
    lines = []
    try:
        for line in launched.stdout:
            lines.append(line)
            if line.startswith("[0] step"):
                break
        pids = [int(l.split()[-1]) for l in lines if l.startswith("launch_local: process ") and " has pid " in l]
        assert len(pids) == 2, "".join(lines[-50:])
        os.kill(launched.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        launched.wait(timeout=10)
        while any(alive(pid) for pid in pids) and time.monotonic() < killed_at + 10:
            time.sleep(0.05)
        print(f"the processes outlived the launcher by {time.monotonic() - killed_at:.2f} s")
        assert not any(alive(pid) for pid in pids)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the workers have sessions of their own: not in this group)
            os.killpg(launched.pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether `pid` runs (not a zombie: the workers' parent is gone, so init reaps them)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def settings(**changes):
    return DistributedConfig(**{"coordinator_address": "", "num_processes": 0, "process_id": -1,
                                "initialization_timeout_seconds": 300, "heartbeat_timeout_seconds": 30, **changes})


def test_settings_come_from_the_config_the_environment_or_the_cluster(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                 "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
        monkeypatch.delenv(name, raising=False)
    assert resolve(settings()) is None  # nothing says otherwise: one process
    assert resolve(settings(num_processes=1, process_id=0)) is None
    explicit = resolve(settings(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2))
    assert (explicit["coordinator_address"], explicit["num_processes"],
            explicit["process_id"]) == ("10.0.0.1:1234", 4, 2)
    assert explicit["heartbeat_timeout_seconds"] == 30
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "head:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert [resolve(settings())[k] for k in ("coordinator_address", "num_processes", "process_id")] == ["head:99", 3, 1]
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name)
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
                        "SLURM_PROCID": "1"}.items():
        monkeypatch.setenv(name, value)
    detected = resolve(settings())  # the count from SLURM; address and id left to JAX's detection
    assert (detected["coordinator_address"], detected["num_processes"], detected["process_id"]) == (None, 2, None)
    with pytest.raises(ConfigError, match=r"process id 5 is not in 0..1 for 2 processes"):
        resolve(settings(process_id=5))

