"""checkpoint.py on checkpoints whose metadata is readable but wrong (docs/checkpoint-format.md,
Reading): a checkpoint that contradicts itself is damaged (renamed `.damaged.*` with one warning,
and the previous one is restored), while a checkpoint that consistently holds another model's
state stops the restore with its remedy and changes nothing on disk."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fixtures import make_mesh
from seqax.checkpoint import Checkpointer
from seqax.config import CheckpointConfig, CheckpointError

SPECS = {"w": P("d", "t"), "b": P(None, "t"), "n": P()}


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": rng.normal(size=(2, 4)).astype(np.float32),
            "n": np.float32(seed)}


def placed(values: dict, mesh) -> dict:
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in values.items()}


def targets(mesh, **changed_shapes):
    shapes = {k: jax.ShapeDtypeStruct(changed_shapes.get(k, np.shape(v)), np.float32) for k, v in state(0).items()}
    return shapes, {k: NamedSharding(mesh, SPECS[k]) for k in shapes}


def checkpoints(directory, steps=(1, 2)) -> Checkpointer:
    """Committed checkpoints of state(step) at each step, on a 4x2 mesh."""
    checkpointer = Checkpointer(str(directory), CheckpointConfig(keep=0, compression="none", level=3, threads=2))
    for step in steps:
        checkpointer.save(step, placed(state(step), make_mesh(4, 2)))
    checkpointer.wait()
    return checkpointer


def edit(path, change):
    metadata = json.loads(open(path).read())
    change(metadata)
    open(path, "w").write(json.dumps(metadata))


def on_disk(directory) -> list[str]:
    """The checkpoint directories, with a damaged one's random suffix left out."""
    return sorted(".".join(n.split(".")[:3]) if n.startswith(".damaged.") else n for n in os.listdir(directory))


def warnings_of(capsys) -> list[str]:
    """The warnings printed on stderr since the last call: one line each, `seqax: warning: ...`."""
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("seqax: warning: ") for line in lines), lines
    return [line.removeprefix("seqax: warning: ") for line in lines]


def restored_falls_back(directory, checkpointer, match: str, capsys):
    mesh = make_mesh(4, 2)
    capsys.readouterr()
    step, tree = checkpointer.restore(*targets(mesh))
    messages = warnings_of(capsys)
    assert len(messages) == 1 and "0000000002 is damaged" in messages[0] and match in messages[0], messages
    assert "kept as " + str(directory / ".damaged.0000000002.") in messages[0]
    assert step == 1 and all(np.array_equal(np.asarray(tree[k]), v) for k, v in state(1).items())
    assert on_disk(directory) == [".damaged.0000000002", "0000000001"]
    checkpointer.close()


def set_step(m):
    m["attributes"]["step"] = 7


def widen_w(m):
    m["shape"] = [8, 8]
    m["chunk_grid"]["configuration"]["chunk_shape"] = [2, 8]


def as_float64(m):
    m["data_type"] = "float64"


@pytest.mark.parametrize("where,change,match", [
    ("zarr.json", set_step, "step attribute is 7, not the 2"),
    ("w/zarr.json", widen_w, "w is float32[8, 8] but the checkpoint recorded float32[8, 4]"),
    ("w/zarr.json", as_float64, "w stores float64 but its dtype attribute says float32"),
])
def test_metadata_that_contradicts_itself_falls_back(tmp_path, where, change, match, capsys):
    checkpointer = checkpoints(tmp_path)
    edit(tmp_path / "0000000002" / where, change)
    restored_falls_back(tmp_path, checkpointer, match, capsys)


def test_a_shape_edited_with_its_record_falls_back_when_older_checkpoints_fit(tmp_path, capsys):
    """Both the array's zarr.json and the group's record edited alike: only the other checkpoints tell."""
    checkpointer = checkpoints(tmp_path)
    edit(tmp_path / "0000000002" / "w" / "zarr.json", widen_w)
    edit(tmp_path / "0000000002" / "zarr.json", lambda m: m["attributes"]["array_shapes"].update(w=[8, 8]))
    restored_falls_back(tmp_path, checkpointer,
                        "w is float32[8, 8] but the state expects float32[8, 4], while checkpoint 1 fits the state",
                        capsys)


def test_an_edited_array_list_falls_back_when_older_checkpoints_fit(tmp_path, capsys):
    checkpointer = checkpoints(tmp_path)
    edit(tmp_path / "0000000002" / "zarr.json", lambda m: m["attributes"].update(arrays=["b", "n"]))
    restored_falls_back(tmp_path, checkpointer,
                        "arrays missing ['w'], unexpected [], while checkpoint 1 fits the state", capsys)


@pytest.mark.parametrize("garble", [lambda p: open(p, "w").write('{"zarr_format": 3, "node_type": "gro'), os.remove])
def test_a_garbled_group_metadata_is_damaged_not_deleted(tmp_path, garble, capsys):
    checkpointer = checkpoints(tmp_path)
    garble(tmp_path / "0000000002" / "zarr.json")
    restored_falls_back(tmp_path, checkpointer, "group metadata zarr.json is unreadable", capsys)


@pytest.mark.parametrize("half_written", ["zarr.json", "zarr.5f0c2a9e41d34b7a8e6f1c2d3b4a5968.partial"])
@pytest.mark.parametrize("older", [[1], []])
def test_an_interrupted_save_whose_group_metadata_is_half_written_is_deleted(tmp_path, half_written, older):
    """Killed while process 0 wrote the group's zarr.json, the first file of a save: nothing else exists.
    zarr writes it as a temporary file renamed to zarr.json (the .partial name: killed before the
    rename, what a run killed at that moment left on 2026-12-04); a file system that writes in place
    could leave zarr.json half written. Either way an uncommitted save: deleted, the run resumes from
    the checkpoint before it, or from step 0 (not 'every committed checkpoint is damaged')."""
    checkpointer = checkpoints(tmp_path, steps=older)
    os.makedirs(tmp_path / "0000000002")
    open(tmp_path / "0000000002" / half_written, "w").write('{"zarr_form')
    restored = checkpointer.restore(*targets(make_mesh(4, 2)))
    checkpointer.close()
    assert (restored[0] if restored else None) == (1 if older else None)
    assert on_disk(tmp_path) == [f"{s:010d}" for s in older]


def test_a_checkpoint_whose_commit_flag_is_false_is_deleted_with_a_line(tmp_path, capsys):
    """A whole checkpoint whose write_completed is false (a save stopped just before its commit; or set by
    hand) is uncommitted: the restore falls back to the one before and deletes it, saying so on stdout."""
    checkpointer = checkpoints(tmp_path)
    edit(tmp_path / "0000000002" / "zarr.json", lambda m: m["attributes"].update(write_completed=False))
    restored = checkpointer.restore(*targets(make_mesh(4, 2)))
    checkpointer.close()
    assert restored[0] == 1 and on_disk(tmp_path) == ["0000000001"]
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "0000000002" in line] == [
        f"seqax: checkpoint {tmp_path / '0000000002'} was never committed (write_completed is not true: its save was "
        "cut short): deleted; training goes on from step 1"]


def test_another_models_checkpoints_stop_the_restore_and_stay(tmp_path):
    """Every checkpoint holds a w of another shape: the config changed, nothing is damaged."""
    checkpointer = checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match=r"array w is float32\[8, 4\] "
                                              r"but the state expects float32\[8, 8\]; use the model config"):
        checkpointer.restore(*targets(make_mesh(4, 2), w=(8, 8)))
    checkpointer.close()
    assert on_disk(tmp_path) == ["0000000001", "0000000002"]


def test_every_checkpoint_damaged_stops_and_renames_nothing(tmp_path, capsys):
    checkpointer = checkpoints(tmp_path)
    for step in ("0000000001", "0000000002"):
        edit(tmp_path / step / "zarr.json", set_step)
    capsys.readouterr()
    with pytest.raises(CheckpointError, match=r"steps \[1, 2\]\); they are left in place"):
        checkpointer.restore(*targets(make_mesh(4, 2)))
    checkpointer.close()
    warned = warnings_of(capsys)
    assert sorted(w.split()[1].rsplit("/", 1)[1] for w in warned) == ["0000000001", "0000000002"]
    assert all("kept as" not in w for w in warned)
    assert on_disk(tmp_path) == ["0000000001", "0000000002"]
