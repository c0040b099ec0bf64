"""Faults we promise to report (docs/reliability.md): damaged datasets, bad values, a full disk.
Each stops with one SeqaxError line naming the thing and the fix, and leaves the disk as it was."""

import errno
import os
import re
import subprocess
import sys

import google_crc32c
import jax
import numpy as np
import pytest
import zarr

import train
from fixtures import abstract_state, make_mesh, snapshot, tiny_config
from seqax.analysis import memory
from seqax.analysis.startup_report import compile_step
from seqax.config import ConfigError, DatasetConfig, DatasetError, load_config
from seqax.data import flat_tokens
from seqax.data.data_loader import make_loader
from seqax.data.flat_tokens import open_flat_tokens, write_flat_tokens
from seqax.validation import validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 256



def documents(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, size=int(rng.integers(5, 60))).astype(np.uint32) for _ in range(n)]


@pytest.fixture(params=[None, 2 * CHUNK], ids=["chunks", "shards"])
def dataset(tmp_path, request) -> str:
    """A dataset of 4+ files per token array; a file per chunk, or one per two chunks."""
    path = str(tmp_path / "data.zarr")
    write_flat_tokens(path, {"train": documents(120, 0), "validation": documents(10, 1)},
                      {"tokenizer": {"kind": "test"}}, chunk_tokens=CHUNK, shard_tokens=request.param)
    return path


def loader(path: str, prefetch: int = 2):
    h = DatasetConfig(path=path, packed=True, seed=0, streams=1, read_block_tokens=CHUNK,
                      shuffle_buffer_tokens=4 * CHUNK, prefetch=prefetch)
    return make_loader(h, open_flat_tokens(path), "train", 8, 32, make_mesh(8, 1))


# ---------------------------------------------------------------------------------------------
# Dataset integrity.


def test_every_file_has_its_recorded_size(dataset):
    split = open_flat_tokens(dataset).splits["train"]
    recorded = split.encoded_tokens.attrs[flat_tokens.STORED_BYTES]
    assert len(recorded) >= 4 and [os.path.getsize(split.file("encoded_tokens", i))
                                   for i in range(len(recorded))] == recorded


@pytest.mark.parametrize("damage,message", [
    (lambda f: os.remove(f), "is missing: chunk 2 of encoded_tokens"),
    (lambda f: os.truncate(f, os.path.getsize(f) - 3),
     r"bytes, not the \d+ written: chunk 2 of encoded_tokens is truncated or damaged"),
])
def test_missing_or_truncated_chunk_stops_at_open(dataset, damage, message):
    path = os.path.join(dataset, "train", "encoded_tokens", "c", "2")
    damage(path)
    before = snapshot(dataset)
    with pytest.raises(DatasetError, match=message) as error:
        open_flat_tokens(dataset)
    assert path in str(error.value) and "\n" not in str(error.value)
    assert snapshot(dataset) == before


def test_a_chunk_unlisted_from_its_shard_index_stops_at_open(tmp_path):
    path = str(tmp_path / "data.zarr")
    write_flat_tokens(path, {"train": documents(120, 0), "validation": documents(10, 1)}, {},
                      chunk_tokens=CHUNK, shard_tokens=2 * CHUNK)
    shard = os.path.join(path, "train", "encoded_tokens", "c", "1")
    data = bytearray(open(shard, "rb").read())
    index = np.frombuffer(bytes(data[-36:-4]), "<u8").copy()  # 2 chunks x (offset, length), then the CRC32C
    index[:2] = 2**64 - 1  # a valid index that says chunk 0 was never written: zarr would read zeros
    data[-36:] = index.tobytes() + np.uint32(google_crc32c.value(index.tobytes())).tobytes()
    open(shard, "wb").write(bytes(data))
    with pytest.raises(DatasetError, match=r"c/1': the index of shard 1 of encoded_tokens "
                                           r"fails its CRC32C or lacks a chunk"):
        open_flat_tokens(path)


def test_a_flipped_byte_stops_the_prefetching_loader_with_the_chunk_named(dataset):
    path = os.path.join(dataset, "train", "encoded_tokens", "c", "1")
    with open(path, "r+b") as f:  # same size: only the CRC32C can tell
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    source = loader(dataset)
    try:
        with pytest.raises(DatasetError, match=r"data.zarr/train/encoded_tokens/c/1' is damaged "
                                               r"\(ValueError: Stored and computed checksum"):
            for step in range(source.order.rows // 8 + 1):
                source.batch(step)
    finally:
        source.close()


def test_a_chunk_deleted_while_training_stops_the_next_read(dataset):
    source = loader(dataset, prefetch=0)
    try:
        os.remove(os.path.join(dataset, "train", "encoded_tokens", "c", "0"))
        with pytest.raises(DatasetError, match="is missing: chunk 0 of encoded_tokens"):
            for step in range(source.order.rows // 8 + 1):
                source.batch(step)
    finally:
        source.close()


def test_a_dataset_without_checksums_is_read_with_one_warning(tmp_path, capsys):
    path = str(tmp_path / "old.zarr")
    group = zarr.open_group(path, mode="w")
    group.attrs.update({"format": flat_tokens.FORMAT, "max_token_id": 99})
    for name, docs in (("train", documents(40, 0)), ("validation", documents(5, 1))):
        encoded, starts = flat_tokens.encode_documents(docs)
        sub = group.create_group(name)
        sub.create_array("encoded_tokens", shape=encoded.shape, dtype=np.uint32, chunks=(CHUNK,))[:] = encoded
        sub.create_array("seq_starts", shape=starts.shape, dtype=np.uint64, chunks=(CHUNK,))[:] = starts
    for _ in range(2):
        dataset = open_flat_tokens(path)
    assert capsys.readouterr().err.count("has no checksums") == 1
    np.testing.assert_array_equal(dataset.splits["train"].read("encoded_tokens", 0, 10),
                                  flat_tokens.encode_documents(documents(40, 0))[0][:10])


def test_garbage_array_metadata_is_one_line(dataset):
    with open(os.path.join(dataset, "train", "encoded_tokens", "zarr.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(DatasetError, match=r"the metadata of train/encoded_tokens is unreadable"):
        open_flat_tokens(dataset)


def test_a_file_as_dataset_path_is_named_a_file(tmp_path):
    path = tmp_path / "data.zarr"
    path.write_text("not a dataset")
    with pytest.raises(DatasetError, match="is a file, not a dataset directory"):
        open_flat_tokens(str(path))


def test_a_full_disk_while_writing_is_one_line_and_keeps_the_old_dataset(dataset, monkeypatch):
    before = snapshot(os.path.dirname(dataset))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zarr.Array, "__setitem__", full)
    with pytest.raises(DatasetError, match=r"writing dataset '.*data.zarr.tmp-\w+' failed: "
                                           r"No space left on device; free space"):
        write_flat_tokens(dataset, {"train": documents(80, 2), "validation": documents(10, 3)}, {}, overwrite=True,
                          chunk_tokens=CHUNK)
    assert snapshot(os.path.dirname(dataset)) == before  # the old dataset whole, no temporary left


@pytest.mark.slow
def test_training_on_a_dataset_with_a_deleted_chunk_exits_before_the_first_step(tmp_path):
    data = str(tmp_path / "synthetic.zarr")
    subprocess.run([sys.executable, "-m", "tools.write_synthetic_dataset", "--output", data], cwd=ROOT, check=True,
                   capture_output=True)
    chunk = os.path.join(data, "train", "encoded_tokens", "c", "2")
    os.remove(chunk)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, "-m", "train", "--config-name=local_test_synthetic",
                             "+paths.model_name=run", f"paths.root_working_dir={tmp_path}", f"dataset.path={data}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"seqax: error: dataset {chunk!r} is missing: chunk 2 of encoded_tokens; write the dataset again"]
    assert not os.path.exists(tmp_path / "run")


# ---------------------------------------------------------------------------------------------
# Values checked at start-up.


@pytest.mark.parametrize("override,message", [
    ("model.layers=0", r"model.layers=0 must be positive"),
    ("model.d_head=0", r"model.d_head=0 must be positive"),
    ("model.n_q_per_kv=0", r"model.n_q_per_kv=0 must be positive"),
    ("model.attention_kernel=flash", r"model.attention_kernel='flash' is not a kernel; choose one of auto, pallas, "
     "pallas_triton, pallas_hopper, blockwise, reference"),
    ("model.matmul_dtype=float16", r"model.matmul_dtype='float16' is not a matmul type; choose one of bfloat16, "
     "float8, float32"),
    ("training.learning_rate=-1e-3", r"training.learning_rate=-0.001 must not be negative"),
    ("training.adam_b1=1.0", r"training.adam_b1=1.0 must be in \[0, 1\)"),
    ("training.adam_b2=-0.1", r"training.adam_b2=-0.1 must be in \[0, 1\)"),
    ("training.adam_eps=0", r"training.adam_eps=0.0 must be positive"),
    ("training.weight_decay=-0.1", r"training.weight_decay=-0.1 must not be negative"),
    ("training.grad_clip=0", r"training.grad_clip=0.0 must be positive"),
    ("training.final_learning_rate_fraction=1.5", r"final_learning_rate_fraction=1.5 must be in \[0, 1\]"),
    ("paths.model_name=''", r"paths.model_name='' must be a plain directory name"),
    ("paths.model_name=a/b", r"paths.model_name='a/b' must be a plain directory name"),
    ("paths.model_name=..", r"paths.model_name='..' must be a plain directory name"),
    ("checkpoints.compression=zstd checkpoints.level=0", r"checkpoints.level=0 is out of range for zstd; choose 1..22"),
    ("checkpoints.compression=blosc checkpoints.level=10",
     r"checkpoints.level=10 is out of range for blosc; choose 0..9"),
    ("model.d_ff=0", r"model.d_ff=0 and model.experts=0 leave no feed-forward layer"),
    ("+model.experts_per_token=2", r"model.experts_per_token=2 and model.expert_d_ff=0 need model.experts > 0"),
    ("+model.experts=4 +model.experts_per_token=5 +model.expert_d_ff=64",
     r"model.experts_per_token=5 must be in 1..model.experts=4"),
    ("+model.experts=4 +model.experts_per_token=2", r"model.expert_d_ff=0 and model.expert_block=64 must be positive"),
    ("+model.experts=6 +model.experts_per_token=2 +model.expert_d_ff=64",
     r"model.experts=6 is not divisible by mesh.d=4: the experts are split over d"),
    ("+training.expert_bias_rate=-0.1", r"training.expert_bias_rate=-0.1 must not be negative"),
    # NaN passed every range check, and an infinite clip or rate is no limit: each diverged at its first step.
    ("training.learning_rate=nan", r"training.learning_rate=nan must be a finite number"),
    ("training.weight_decay=nan", r"training.weight_decay=nan must be a finite number"),
    ("training.adam_eps=inf", r"training.adam_eps=inf must be a finite number"),
    ("training.grad_clip=inf", r"training.grad_clip=inf must be a finite number"),
    ("+training.expert_bias_rate=nan", r"training.expert_bias_rate=nan must be a finite number"),
    ("model.rope_base=-inf", r"model.rope_base=-inf must be a finite number"),
    ("model.norm_eps=0", r"model.norm_eps=0.0 must be positive"),
    # An OverflowError traceback once the run had taken its lock (was).
    ("training.seed=18446744073709551616", r"training.seed=18446744073709551616 does not fit in 64 bits"),
    ("dataset.seed=9223372036854775808", r"dataset.seed=9223372036854775808 does not fit in 64 bits"),
    ("mesh.d=-4 mesh.t=-2", r"mesh.d=-4, mesh.t=-2 and mesh.c=1 must be positive"),  # was: -4 x -2 = 8 must equal 8
])
def test_bad_values_are_one_line_with_the_remedy(override, message):
    overrides = override.split(" ")
    if not override.startswith("paths.model_name"):
        overrides.append("+paths.model_name=run")
    else:
        overrides[0] = "+" + overrides[0]
    cfg = load_config("local_test_synthetic", overrides)
    with pytest.raises(ConfigError, match=message) as error:
        validate_config(cfg, 8, max_token_id=10, weights=train.Model)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("edge,past", [
    ("training.adam_b1=0.0", "training.adam_b1=-0.01"),
    ("training.adam_b2=0.999999", "training.adam_b2=1.0"),
    ("training.weight_decay=0.0", "training.weight_decay=-1e-9"),
    ("training.final_learning_rate_fraction=1.0", "training.final_learning_rate_fraction=1.01"),
    ("training.final_learning_rate_fraction=0.0", "training.final_learning_rate_fraction=-0.01"),
    ("checkpoints.compression=zstd checkpoints.level=22", "checkpoints.compression=zstd checkpoints.level=23"),
    ("checkpoints.compression=blosc checkpoints.level=0", "checkpoints.compression=blosc checkpoints.level=-1"),
    ("model.layers=1", "model.layers=0"),
])
def test_each_check_rejects_only_past_its_edge(edge, past):
    """A value at the edge of its range passes and the next one past it is refused, naming the key:
    the checks reject exactly what their messages say."""
    def check(override):
        cfg = load_config("local_test_synthetic", ["+paths.model_name=run", *override.split(" ")])
        return validate_config(cfg, 8, max_token_id=10, weights=train.Model)

    assert check(edge) is None
    with pytest.raises(ConfigError, match=re.escape(past.split(" ")[-1].split("=")[0])):
        check(past)


@pytest.mark.parametrize("where", ["equal", "inside"])
def test_prepare_dataset_refuses_an_output_that_is_or_holds_an_input(tmp_path, capsys, where):
    from tools import prepare_dataset

    text = tmp_path / "out" / "text.txt" if where == "inside" else tmp_path / "text.txt"
    text.parent.mkdir(exist_ok=True)
    text.write_text("a document\n\nanother one\n")
    output = tmp_path / "out" if where == "inside" else text
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit:
        prepare_dataset.main([str(text), "--output", str(output), "--overwrite", "--workers", "1", "--quiet",
                              "--txt-documents", "paragraph"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"prepare_dataset: error: --output '{output}' is or contains the input '{text}', "
        "which writing it would delete; choose another --output"]
    assert snapshot(tmp_path) == before


@pytest.mark.slow  # compiles a whole training step (about 10 s)
def test_a_step_that_cannot_fit_the_free_memory_is_one_line(monkeypatch):
    """The compiled step of a tiny config, against a host with 1 MiB free: one line naming both
    sizes and the keys to lower, before any step runs."""
    cfg = tiny_config()
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t)
    with jax.set_mesh(mesh):
        compiled = compile_step(train.training_step, cfg, abstract_state(cfg, mesh), mesh)
    memory.check_step_fits(compiled, mesh)  # fits the real machine
    monkeypatch.setattr(memory, "free_memory", lambda device: 2**20)
    with pytest.raises(ConfigError, match=r"the training step needs [\d.]+ GiB per device beyond its state "
                                          r".* x 8 device\(s\) sharing memory, more than the 0.00 GiB free on cpu; "
                                          r"lower training.tokens.batch or training.tokens.len"):
        memory.check_step_fits(compiled, mesh)
