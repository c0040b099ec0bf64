"""checkpoint.py: bitwise round trips (bf16 too) on any mesh and process count, damaged and
uncommitted checkpoints, asynchronous saving, and real training runs killed and resumed."""

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from functools import partial

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zarr
from checkpoint_process import is_spec_pair, put, sample_values
from jax.sharding import NamedSharding

import train
from fixtures import (
    fill,
    make_mesh,
    mounted,
    put_batch,
    random_batch,
    random_state,
    run_processes,
    start_train,
    synthetic_dataset,
    tiny_config,
    tiny_overrides,
    train_args,
)
from seqax import run_lock, sharded_zarr
from seqax.checkpoint import Checkpointer
from seqax.config import CheckpointConfig, CheckpointError, ConfigError, DivergedError, OutputError
from seqax.shardlib.shardtypes import make_shardings


def checkpoint_config(**changes) -> CheckpointConfig:
    return CheckpointConfig(**{"keep": 0, "compression": "none", "level": 3, "threads": 4, **changes})


def targets_on(values: dict, mesh):
    """(shapes, shardings) of `values` (as made by sample_values) placed on `mesh`."""
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v[0]), v[0].dtype), values, is_leaf=is_spec_pair)
    return shapes, jax.tree.map(lambda v: NamedSharding(mesh, v[1]), values, is_leaf=is_spec_pair)


def host_bytes(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def value_bytes(values: dict) -> list[bytes]:
    return [np.asarray(v[0]).tobytes() for v in jax.tree.leaves(values, is_leaf=is_spec_pair)]


def saved(directory, values, steps=(1,), **changes) -> Checkpointer:
    """A checkpointer that has committed `values` (on a 4x2 mesh) at each of `steps`."""
    checkpointer = Checkpointer(str(directory), checkpoint_config(**changes))
    tree = put(values, make_mesh(4, 2))
    for step in steps:
        checkpointer.save(step, tree)
    checkpointer.wait()
    return checkpointer


# ---------------------------------------------------------------------------------------------
# Round trips and the format.


@pytest.mark.parametrize("compression", ["none", "zstd", "blosc"])
def test_round_trip_is_bitwise_on_any_mesh(tmp_path, compression, monkeypatch):
    monkeypatch.setattr(sharded_zarr, "PIECE", 24)  # the direct path checksums and writes a chunk in pieces
    values = sample_values()
    checkpointer = saved(tmp_path, values, steps=[3], compression=compression)
    for d, t in [(4, 2), (2, 4), (1, 1)]:
        step, tree = checkpointer.restore(*targets_on(values, make_mesh(d, t)))
        assert step == 3 and host_bytes(tree) == value_bytes(values), (d, t)
        assert (tree["weights"]["b"].dtype == jnp.bfloat16
                and tree["weights"]["b"].sharding.mesh.shape == {"d": d, "c": 1, "t": t})
    checkpointer.close()
    # What any zarr reader sees: bf16 as uint16 plus its name, one chunk per shard of the 4x2 mesh.
    group = zarr.open_group(str(tmp_path / "0000000003"), mode="r")
    assert ({k: group.attrs[k] for k in ("step", "format_version", "write_completed")}
            == {"step": 3, "format_version": 1, "write_completed": True})
    b = group["weights.b"]
    assert b.dtype == np.uint16 and b.attrs["dtype"] == "bfloat16" and b.chunks == (8, 4)
    assert b[:].tobytes() == values["weights"]["b"][0].tobytes()  # zarr checks every CRC32C as it reads
    assert group["layers.0"].chunks == (2, 8, 2) and group["weights.w"].chunks == (2, 2) and group["count"][()] == 7


@pytest.mark.slow
def test_restore_on_other_meshes_continues_training(tmp_path):
    """Save a state on 4x2; restore on 8x1, 2x4 and 1x1: the same bits and the same next loss."""
    cfg = tiny_config()
    host_batch = random_batch(0, cfg.training.tokens.batch, cfg.training.tokens.len, cfg.model.vocab)

    def next_loss(state, mesh):
        with jax.set_mesh(mesh):
            return float(train.training_step(state, jnp.uint32(7), *put_batch(mesh, host_batch), cfg)[1].loss)

    mesh = make_mesh(4, 2)
    state = random_state(cfg, mesh)
    checkpointer = Checkpointer(str(tmp_path), checkpoint_config())
    checkpointer.save(7, state)
    checkpointer.wait()
    expected_bytes, expected_loss = host_bytes(state), next_loss(state, mesh)
    for d, t in [(8, 1), (2, 4), (1, 1)]:
        mesh = make_mesh(d, t)
        step, restored = checkpointer.restore(jax.eval_shape(lambda m=mesh: train.init_state(cfg, m)),
                                              make_shardings(train.State, mesh))
        assert step == 7 and host_bytes(restored) == expected_bytes, (d, t)
        loss = next_loss(restored, mesh)
        assert abs(loss - expected_loss) <= 1e-4 * abs(expected_loss), (d, t, loss, expected_loss)
    checkpointer.close()


@pytest.mark.slow
def test_two_processes_save_and_restore(tmp_path):
    """Two processes of 4 devices save (each writing its own shards) and restore on 2x4; this
    process then restores the same checkpoint on 8 devices and on 1."""
    run_processes("checkpoint_process.py", 2, str(tmp_path))
    values = sample_values()
    checkpointer = Checkpointer(str(tmp_path), checkpoint_config())
    for d, t in [(8, 1), (1, 1)]:
        step, tree = checkpointer.restore(*targets_on(values, make_mesh(d, t)))
        assert step == 3 and host_bytes(tree) == value_bytes(values)
    checkpointer.close()
    assert [n for n in os.listdir(tmp_path / "0000000003") if n.startswith(".")] == []  # the commit markers are gone
    group = zarr.open_group(str(tmp_path / "0000000003"), mode="r")
    assert group["weights.w"].shards == (4, 4) and group["weights.w"].chunks == (2, 2)  # one file per process
    assert (group["interleaved"].shards is None
            and group["interleaved"].chunks == (2, 4))  # alternate rows: a file per chunk
    assert sorted(os.listdir(tmp_path / "0000000003" / "weights.w" / "c")) == ["0", "1"]


# ---------------------------------------------------------------------------------------------
# Damaged, uncommitted and mismatched checkpoints.


def garble(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def unlist_a_chunk(path):
    """A shard whose index (with a valid checksum) says that its first chunk was never written,
    which zarr itself would read as zeros."""
    data = bytearray(open(path, "rb").read())
    n = 4 * 2  # chunks in the shard of weights.w: the whole (8, 4) array in (2, 2) chunks
    index = np.frombuffer(bytes(data[-16 * n - 4 : -4]), "<u8").copy()
    index[:2] = 2**64 - 1
    data[-16 * n - 4 :] = index.tobytes() + np.uint32(google_crc32c.value(index.tobytes())).tobytes()
    open(path, "wb").write(bytes(data))


DAMAGES = [("none", garble), ("none", truncate), ("none", os.remove), ("none", unlist_a_chunk),
           ("zstd", garble), ("zstd", truncate), ("zstd", unlist_a_chunk)]


@pytest.mark.parametrize("compression,damage", DAMAGES)
def test_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, compression, damage, capsys):
    values = sample_values()
    checkpointer = saved(tmp_path, values, steps=[1, 2], compression=compression)
    damage(str(tmp_path / "0000000002" / "weights.w" / "c" / "0" / "0"))  # one process: the whole array is one shard
    capsys.readouterr()
    step, tree = checkpointer.restore(*targets_on(values, make_mesh(8, 1)))
    warned = capsys.readouterr().err.splitlines()  # one line, without Python's source line of a UserWarning
    assert len(warned) == 1 and re.match(r"seqax: warning: checkpoint .*0000000002 is damaged", warned[0]), warned
    assert step == 1 and host_bytes(tree) == value_bytes(values)
    assert checkpointer.complete_steps() == [1]  # the damaged one is moved aside, to be written again
    assert [n.split(".")[:3] for n in os.listdir(tmp_path) if n.startswith(".")] == [["", "damaged", "0000000002"]]
    checkpointer.save(2, tree)
    checkpointer.close()
    assert checkpointer.complete_steps() == [1, 2]


def test_every_checkpoint_damaged_is_an_error(tmp_path, capsys):
    values = sample_values()
    checkpointer = saved(tmp_path, values, steps=[1])
    garble(str(tmp_path / "0000000001" / "norm" / "c" / "0"))
    capsys.readouterr()
    with pytest.raises(CheckpointError, match="every committed checkpoint"):
        checkpointer.restore(*targets_on(values, make_mesh(4, 2)))
    checkpointer.close()
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1 and re.match(r"seqax: warning: checkpoint .*0000000001 is damaged", warned[0]), warned


def test_uncommitted_checkpoint_is_skipped_and_later_overwritten(tmp_path):
    values = sample_values()
    checkpointer = saved(tmp_path, values, steps=[1, 2])
    meta_path = tmp_path / "0000000002" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["write_completed"] = False  # as if killed before the commit
    meta_path.write_text(json.dumps(meta))
    os.remove(tmp_path / "0000000002" / "weights.w" / "c" / "0" / "0")
    assert checkpointer.latest_step() == 1
    step, tree = checkpointer.restore(*targets_on(values, make_mesh(4, 2)))
    assert step == 1 and not (tmp_path / "0000000002").exists()
    changed = jax.tree.map(lambda x: x + 1 if x.dtype != jnp.uint32 else x, tree)
    checkpointer.save(2, changed)
    checkpointer.wait()
    step, tree = checkpointer.restore(*targets_on(values, make_mesh(4, 2)))
    checkpointer.close()
    assert step == 2 and host_bytes(tree) == host_bytes(changed)


def test_mismatched_state_names_the_array_and_both_shapes(tmp_path):
    values = sample_values()
    checkpointer = saved(tmp_path, values)
    shapes, shardings = targets_on(values, make_mesh(4, 2))
    wider = {**shapes, "weights": {**shapes["weights"], "w": jax.ShapeDtypeStruct((8, 8), np.float32)}}
    with pytest.raises(CheckpointError, match=r"weights\.w is float32\[8, 4\] but the state expects float32\[8, 8\]"):
        checkpointer.restore(wider, shardings)
    as_f32 = {**shapes, "weights": {**shapes["weights"], "b": jax.ShapeDtypeStruct((8, 8), np.float32)}}
    with pytest.raises(CheckpointError, match=r"weights\.b is bfloat16\[8, 8\] but the state expects float32\[8, 8\]"):
        checkpointer.restore(as_f32, shardings)
    with pytest.raises(CheckpointError, match=r"missing \['extra'\]"):
        checkpointer.restore({**shapes, "extra": shapes["norm"]}, {**shardings, "extra": shardings["norm"]})
    checkpointer.close()
    assert checkpointer.complete_steps() == [1]  # a mismatch deletes nothing


def test_keeps_the_newest_complete_checkpoints(tmp_path):
    checkpointer = saved(tmp_path, sample_values(), steps=[1, 2, 3, 4], keep=2)
    checkpointer.close()
    assert sorted(os.listdir(tmp_path)) == ["0000000003", "0000000004"]


def test_keep_1_keeps_the_checkpoint_before_the_newest_whose_loss_is_not_yet_known(tmp_path):
    """Checkpoint N's loss is read only when step N runs: until the next save, N - 1 (whose loss was) stays."""
    checkpointer = saved(tmp_path, sample_values(), steps=[1, 2, 3, 4], keep=1)
    checkpointer.close()
    assert sorted(os.listdir(tmp_path)) == ["0000000003", "0000000004"]


def test_a_state_with_a_nan_or_inf_is_not_saved_by_a_finite_only_checkpointer(tmp_path):
    """A training run's checkpointer (finite_only) refuses a state with a NaN (sample_values has NaN and inf
    in a bfloat16 leaf), names the step, and writes nothing; a finite state saves."""
    values = sample_values()
    checkpointer = Checkpointer(str(tmp_path), checkpoint_config(), finite_only=True)
    with pytest.raises(DivergedError, match=r"^the state after step 4 holds NaN or inf: training diverged") as error:
        checkpointer.save(5, put(values, make_mesh(4, 2)))
    assert error.value.step == 5 and os.listdir(tmp_path) == []
    b, spec = values["weights"]["b"]
    b = np.nan_to_num(b.astype(np.float32), posinf=1.0).astype(b.dtype)
    finite = {**values, "weights": {**values["weights"], "b": (b, spec)}}
    checkpointer.save(5, put(finite, make_mesh(4, 2)))
    checkpointer.close()
    assert checkpointer.complete_steps() == [5]


def test_bad_config_is_refused():
    with pytest.raises(ConfigError, match="compression='lz4'"):
        Checkpointer("unused", checkpoint_config(compression="lz4"))


# ---------------------------------------------------------------------------------------------
# Asynchronous saving.


def each_write(monkeypatch, wrap):
    """Every file write of a checkpoint (the jobs of sharded_zarr.write_jobs) runs as `wrap(job)`."""
    write_jobs = sharded_zarr.write_jobs
    monkeypatch.setattr(sharded_zarr, "write_jobs",
                        lambda *args, **kw: [[partial(wrap, job) for job in file] for file in write_jobs(*args, **kw)])


def test_save_returns_before_the_write_and_owns_its_copy(tmp_path, monkeypatch):
    release = threading.Event()
    each_write(monkeypatch, lambda job: (release.wait(30), job()))
    values = sample_values()
    tree = put(values, make_mesh(4, 2))
    checkpointer = Checkpointer(str(tmp_path), checkpoint_config())
    checkpointer.save(5, tree)
    assert checkpointer.latest_step() is None  # the files are still being written
    jax.jit(lambda t: jax.tree.map(lambda x: x * 0, t), donate_argnums=0)(tree)  # as the next step would
    release.set()
    checkpointer.wait()
    step, restored = checkpointer.restore(*targets_on(values, make_mesh(4, 2)))
    checkpointer.close()
    assert step == 5 and host_bytes(restored) == value_bytes(values)


def test_failed_background_write_stops_training(tmp_path, monkeypatch):
    def fail(job):
        raise OSError(errno.ENOSPC, "No space left on device", "/a/chunk")

    each_write(monkeypatch, fail)
    checkpointer = Checkpointer(str(tmp_path), checkpoint_config())
    checkpointer.save(1, put(sample_values(), make_mesh(4, 2)))
    # One line for the user (a SeqaxError), naming the cause, the file and what is intact.
    message = (r"failed: No space left on device \(/a/chunk\); no checkpoint was committed; "
               r"fix the cause and run the same command again")
    with pytest.raises(CheckpointError, match=message):
        for _ in range(1000):  # the loop calls check() every step
            checkpointer.check()
            time.sleep(0.01)
    checkpointer.close()
    assert checkpointer.latest_step() is None


@pytest.mark.parametrize("locked", [False, True], ids=["a folder", "a locked run"])
@pytest.mark.parametrize("when", ["checked", "its arrays are written"])
def test_a_run_directory_deleted_during_a_save_is_not_made_again(tmp_path, monkeypatch, when, locked):
    """The run directory removed (rm -rf) while a checkpoint is saved: just after the save checked that it is
    the run's, or once the checkpoint's arrays are written (before the commit). The save fails in one line
    naming what is missing, and nothing under the run directory is made again. (The save made the folder of
    checkpoints with makedirs, and with it the run directory: a run directory deleted under a live run came
    back with a checkpoint in it, now and then, in test_run_lock's end-to-end test. The commit is written
    by this module too, not zarr's store, which makes every missing folder above a file it writes.)
    A training run's directory (it holds the run's lock) says that the directory went, as the run's step
    check does: the file the write lost is not the cause to fix (it said 'fix the cause and run the same
    command again', now and then, in test_run_lock's end-to-end test, when the write failed first)."""
    run = tmp_path / "run"
    run.mkdir()
    with run_lock.hold(str(run)) if locked else contextlib.nullcontext():
        checkpointer = Checkpointer(str(run / "checkpoints"), checkpoint_config())
        if when == "checked":
            identity = run_lock.path_identity

            def identity_then_delete(path):
                found = identity(path)
                if os.fspath(path) == str(run):
                    shutil.rmtree(run)
                return found

            monkeypatch.setattr(run_lock, "path_identity", identity_then_delete)
        else:
            wait_for = Checkpointer._wait

            def wait(self, condition, step, what):
                wait_for(self, condition, step, what)
                if what.startswith("every process to write"):
                    shutil.rmtree(run)

            monkeypatch.setattr(Checkpointer, "_wait", wait)
        checkpointer.save(1, put(sample_values(), make_mesh(4, 2)))
        deleted = re.escape(f"the run directory '{run}' was deleted, moved or replaced while this run was writing it")
        with pytest.raises(OutputError if locked else CheckpointError,
                           match=deleted if locked else r"failed: .*; no checkpoint was committed; fix the cause"):
            checkpointer.wait()
        checkpointer.close()
    assert not run.exists()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_full_disk_names_the_file_whose_write_failed(tmp_path, compression):
    """On a real full disk (a 1 MiB tmpfs for 2 MiB of weights) the OS's error names no file; the line
    names the file (direct writes) or the array (zarr's) whose write failed, as a read-only disk's does."""
    mesh = make_mesh(8, 1)
    noise = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)  # zstd cannot shrink it
    big = jax.device_put(noise, NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    with mounted(tmp_path / "disk", "size=1m"):
        checkpointer = Checkpointer(str(tmp_path / "disk" / "checkpoints"), checkpoint_config(compression=compression,
                                                                                               level=1))
        checkpointer.save(1, {"w": big})
        where = r"0000000001/w/c/\d+/0" if compression == "none" else r"0000000001/w"
        with pytest.raises(CheckpointError, match=rf"failed: No space left on device \(\S*{where}\); "
                                                  "no checkpoint was committed"):
            checkpointer.wait()
        checkpointer.close()


def test_a_save_that_a_full_disk_stopped_at_its_first_file_is_not_taken_for_damage(tmp_path):
    """The group's zarr.json, written first, not written (or cut short) on a full disk, and the
    save's `.failed` marker: an uncommitted save, deleted at the restore (was: a damaged checkpoint,
    and with no other, `every committed checkpoint ... is damaged`: a run that could not resume)."""
    with mounted(tmp_path / "disk", "size=1m") as disk:
        checkpointer = Checkpointer(str(disk / "checkpoints"), checkpoint_config())
        os.makedirs(disk / "checkpoints")
        filler = fill(disk)
        checkpointer.save(1, put(sample_values(), make_mesh(4, 2)))
        with pytest.raises(CheckpointError, match=r"No space left on device \(\S*0000000001"):
            checkpointer.wait()
        left = set(os.listdir(disk / "checkpoints" / "0000000001")) - {"zarr.json"}
        assert len(left) == 1 and left.pop().startswith(".failed."), left
        os.remove(filler)
        assert checkpointer.restore(*targets_on(sample_values(), make_mesh(4, 2))) is None
        assert os.listdir(disk / "checkpoints") == []
        checkpointer.close()


# ---------------------------------------------------------------------------------------------
# Real training runs: SIGKILL at several moments, SIGTERM, and restarts.

STEPS, INTERVAL = 24, 3


def train_process(root, dataset, name, cache, *changes: str) -> subprocess.Popen:
    overrides = tiny_overrides(f"training.steps={STEPS}", f"checkpoint_interval={INTERVAL}", "checkpoints.keep=0",
                               *changes)
    # No training_step.svg (graph=False, fixtures.child_env): nothing here reads it, and a killed
    # run's `dot` would draw on.
    return start_train(train_args(root, dataset, name, *overrides), cache=cache, graph=False, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)


def logged(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    return [line for line in map(json.loads, lines) if "loss" in line]


def committed(run_dir) -> dict[int, bool]:
    """Every checkpoint directory of the run (docs/checkpoint-format.md): step -> committed."""
    directory, steps = os.path.join(run_dir, "checkpoints"), {}
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if len(name) == 10 and name.isdigit():
            try:
                with open(os.path.join(directory, name, "zarr.json")) as f:
                    steps[int(name)] = json.load(f)["attributes"]["write_completed"] is True
            except (OSError, ValueError, KeyError):
                steps[int(name)] = False
    return steps


def wait_until(condition, process, what):
    deadline = time.monotonic() + 120
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.stderr.read()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


@pytest.mark.slow
def test_killed_and_preempted_runs_continue_with_the_same_losses(tmp_path):
    dataset, cache = synthetic_dataset(tmp_path / "data.zarr", "--train-tokens", "300000",
                                       "--validation-tokens", "20000"), tmp_path / "jax_cache"
    reference = train_process(tmp_path, dataset, "reference", cache)
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    expected = {line["step"]: line["loss"] for line in logged(tmp_path / "reference")}
    assert sorted(expected) == list(range(STEPS))

    run_dir, rng = tmp_path / "interrupted", random.Random(0)
    first_lines = []  # (lines before the launch, committed checkpoints at the launch)

    def launch():
        first_lines.append((len(logged(run_dir)), committed(run_dir) if run_dir.exists() else {}))
        return train_process(tmp_path, dataset, "interrupted", cache)

    # SIGKILL at a random moment while training.
    run = launch()
    lines = rng.randint(2, 5)
    wait_until(lambda: len(logged(run_dir)) >= lines, run, f"{lines} steps")
    time.sleep(rng.uniform(0, 0.05))
    run.kill()
    run.wait()
    # SIGKILL while a checkpoint is being written (after the run has trained a step).
    run = launch()
    wait_until(lambda: len(logged(run_dir)) > first_lines[-1][0], run, "a step of the second run")
    wait_until(lambda: not all(committed(run_dir).values()), run, "a checkpoint being written")
    run.kill()
    run.wait()
    uncommitted = [s for s, done in committed(run_dir).items() if not done]
    # SIGTERM: a checkpoint at the step it arrived, exit status 0.
    run = launch()
    wait_until(lambda: len(logged(run_dir)) >= first_lines[-1][0] + 2, run, "two steps of the third run")
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=120) == 0, run.stderr.read()
    preempted_at = logged(run_dir)[-1]["step"] + 1
    assert preempted_at < STEPS and committed(run_dir).get(preempted_at) is True
    # The rest of the run.
    run = launch()
    assert run.wait(timeout=300) == 0, run.stderr.read()

    lines = logged(run_dir)
    for before, checkpoints in first_lines[1:]:  # each restart resumed from the newest committed checkpoint
        assert lines[before]["step"] == max([s for s, done in checkpoints.items() if done], default=0)
    assert first_lines[3][1][preempted_at] and lines[first_lines[3][0]]["step"] == preempted_at
    assert uncommitted and all(first_lines[2][1][s] is False for s in uncommitted)  # killed mid-write, then skipped
    assert {line["step"]: line["loss"] for line in lines} == expected  # the last line of each step, bitwise
    assert all(committed(run_dir).values()) and set(uncommitted) <= set(committed(run_dir))  # ... and later overwritten

    # A model that does not fit the checkpoints stops the run with one line, leaving the run as it was.
    files = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    run = train_process(tmp_path, dataset, "interrupted", cache, "model.d_ff=256")
    assert run.wait(timeout=120) == 2
    errors = run.stderr.read().strip().splitlines()
    expected_error = (r"^seqax: error: checkpoint .*24: array weights\.layers\.\w+ is float32\[2, 64, 128\] "
                      r"but the state expects float32\[2, 64, 256\]")
    assert len(errors) == 1 and re.search(expected_error, errors[0]), errors
    assert files == {name: (run_dir / name).read_bytes() for name in files} and all(committed(run_dir).values())
