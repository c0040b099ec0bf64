"""tools/prepare_dataset.py: text -> flat-tokens -> text, validation choice, and bad inputs."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import train
from fixtures import ROOT, child_env, decoded, mounted
from seqax.config import ConfigError, DatasetError, load_config
from seqax.data.flat_tokens import FlatTokensWriter, open_flat_tokens
from tools import prepare_dataset

PIECES = ["héllo wörld", "naïve café", "日本語のテキスト", "def f(x):\n    return x * 2", "plain ascii"]
DOCUMENTS = [f"Document {i}: " + " ".join(PIECES[: 1 + i % 5]) * (1 + i % 3) for i in range(30)]


def run(argv):
    prepare_dataset.main(argv + ["--workers", "1", "--quiet"])


def run_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prepare_dataset: error: ")
    return err[0]


def assert_round_trip(path: str, documents: list[str], ordered=("train", "validation")):
    splits = decoded(path)
    assert sorted(splits["train"] + splits["validation"]) == sorted(documents)
    for name in ordered:  # these splits keep the input order
        positions = [documents.index(d) for d in splits[name]]
        assert positions == sorted(positions)


def write_inputs(folder, kind: str) -> list[str]:
    """Writes DOCUMENTS in one input format; returns the arguments that name them."""
    os.makedirs(folder, exist_ok=True)
    if kind == "files":
        for i, d in enumerate(DOCUMENTS):
            with open(os.path.join(folder, f"doc{i:03d}.txt"), "w", encoding="utf-8", newline="") as f:
                f.write(d)
        return [str(folder)]
    if kind == "paragraph":
        path = os.path.join(folder, "all.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n  \n".join(DOCUMENTS) + "\n")  # blocks of several lines, blank lines with spaces
        return [path, "--txt-documents", "paragraph"]
    if kind == "jsonl":
        path = os.path.join(folder, "all.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCUMENTS))
        return [path]
    import pyarrow
    import pyarrow.parquet

    path = os.path.join(folder, "all.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"body": DOCUMENTS}), path, row_group_size=7)
    return [path, "--text-field", "body"]


@pytest.mark.parametrize("kind", ["files", "paragraph", "jsonl", "parquet"])
def test_byte_round_trip(tmp_path, kind):
    args = write_inputs(tmp_path / "in", kind)
    out = str(tmp_path / "out.zarr")
    run(args + ["--output", out, "--validation-documents", "4"])
    assert_round_trip(out, DOCUMENTS, ordered=["validation"])
    dataset = open_flat_tokens(out)
    # every document ends with <eos>
    assert dataset.attrs["tokenizer"]["kind"] == "bytes" and dataset.max_token_id == 257
    assert len(decoded(out)["validation"]) == 4


def test_bpe_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tokenizer.train_from_iterator(DOCUMENTS, trainer)
    tokenizer_path = str(tmp_path / "tokenizer.json")
    tokenizer.save(tokenizer_path)
    out = str(tmp_path / "bpe.zarr")
    run(write_inputs(tmp_path / "in", "jsonl") + ["--output", out, "--tokenizer", tokenizer_path,
                                                  "--eos-token", "<eos>", "--validation-fraction", "0.2"])
    assert_round_trip(out, DOCUMENTS)
    info = open_flat_tokens(out).attrs["tokenizer"]
    assert info["kind"] == "tokenizers" and info["eos_id"] == tokenizer.token_to_id("<eos>") + 1
    bytes_out = str(tmp_path / "bytes.zarr")
    run(write_inputs(tmp_path / "in", "jsonl") + ["--output", bytes_out, "--validation-fraction", "0.2"])
    assert (open_flat_tokens(out).splits["train"].num_tokens
            < open_flat_tokens(bytes_out).splits["train"].num_tokens / 2)  # BPE merges
    assert decoded(out)["validation"] == decoded(bytes_out)["validation"]  # the choice does not depend on the tokenizer


@pytest.mark.slow  # the datasets library's start-up (about 4 s)
def test_hugging_face_streaming_from_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = write_inputs(tmp_path / "in", "jsonl")[0]
    out = str(tmp_path / "hf.zarr")
    run(["--hf-dataset", "json", "--hf-data-files", path, "--output", out, "--validation-fraction", "0.2"])
    assert_round_trip(out, DOCUMENTS)


def test_validation_choice(tmp_path):
    args = write_inputs(tmp_path / "in", "jsonl")
    run(args + ["--output", str(tmp_path / "a.zarr"), "--validation-fraction", "0.3"])
    run(args + ["--output", str(tmp_path / "b.zarr"), "--validation-fraction", "0.3", "--workers", "2"])
    a, b = decoded(str(tmp_path / "a.zarr")), decoded(str(tmp_path / "b.zarr"))
    assert a == b and 3 <= len(a["validation"]) <= 18
    run(args + ["--output", str(tmp_path / "c.zarr"), "--validation-fraction", "0.3", "--seed", "1"])
    assert decoded(str(tmp_path / "c.zarr"))["validation"] != a["validation"]
    run(args + ["--output", str(tmp_path / "d.zarr"), "--validation-documents", "7"])
    assert len(decoded(str(tmp_path / "d.zarr"))["validation"]) == 7


def test_max_tokens(tmp_path):
    out = str(tmp_path / "cut.zarr")
    run(write_inputs(tmp_path / "in", "jsonl") + ["--output", out, "--max-tokens", "1000",
                                                  "--validation-documents", "1"])
    dataset = open_flat_tokens(out)
    assert dataset.splits["train"].num_tokens + dataset.splits["validation"].num_tokens == 1000


def test_existing_output_is_kept_without_overwrite(tmp_path, capsys):
    args = write_inputs(tmp_path / "in", "jsonl") + ["--output", str(tmp_path / "out.zarr"),
                                                     "--validation-documents", "1"]
    run(args + ["--max-tokens", "500"])
    assert "exists; pass --overwrite" in run_error(args, capsys)
    assert (open_flat_tokens(str(tmp_path / "out.zarr")).attrs["train_tokens"]
            + open_flat_tokens(str(tmp_path / "out.zarr")).attrs["validation_tokens"] == 500)
    run(args + ["--overwrite"])
    assert_round_trip(str(tmp_path / "out.zarr"), DOCUMENTS, ordered=["validation"])
    assert glob.glob(str(tmp_path / "out.zarr.*")) == []


def test_interrupted_run_leaves_no_dataset(tmp_path, monkeypatch):
    def interrupt(self, docs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_dataset.Splitter, "add", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(write_inputs(tmp_path / "in", "jsonl") + ["--output", str(tmp_path / "out.zarr")])
    assert not os.path.exists(tmp_path / "out.zarr") and glob.glob(str(tmp_path / "out.zarr*")) == []
    # Killed without cleanup: the temporary directory is not a dataset.
    writer = FlatTokensWriter(str(tmp_path / "killed.zarr"))
    writer.add_documents("train", [np.arange(1, 5, dtype=np.uint32)])
    writer.add_documents("validation", [np.arange(1, 5, dtype=np.uint32)])
    with pytest.raises(DatasetError, match="format None"):
        open_flat_tokens(writer.tmp)
    assert not os.path.exists(tmp_path / "killed.zarr")


def test_empty_input_is_one_error(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert "hold no documents" in run_error([str(tmp_path / "empty.txt"), "--output", str(tmp_path / "out.zarr")],
                                            capsys)
    assert not os.path.exists(tmp_path / "out.zarr")


def test_tokenizer_with_ids_beyond_2_31_is_one_error(tmp_path, capsys):
    big = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2**31 - 1}, "unk_token": "[UNK]"}}
    (tmp_path / "big.json").write_text(json.dumps(big))
    args = write_inputs(tmp_path / "in", "jsonl") + ["--output", str(tmp_path / "out.zarr"), "--tokenizer",
                                                     str(tmp_path / "big.json")]
    assert "has token id 2147483647" in run_error(args, capsys)


@pytest.mark.slow  # two tokenizer processes start (about 3 s)
def test_a_binary_jsonl_input_is_one_line_through_the_worker_processes(tmp_path):
    """`python -m tools.prepare_dataset` with a .jsonl of bytes that are not UTF-8 and two workers (the
    file is read in the pool's feeder thread): one line naming the file, line and byte, exit 2 (was: a
    UnicodeDecodeError traceback through multiprocessing); no dataset written."""
    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    (tmp_path / "binary.jsonl").write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + bytes(range(128, 256)))
    result = subprocess.run([sys.executable, "-m", "tools.prepare_dataset", str(tmp_path / "good.jsonl"),
                             str(tmp_path / "binary.jsonl"), "--output", str(tmp_path / "out.zarr"), "--workers", "2",
                             "--quiet"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"prepare_dataset: error: {tmp_path / 'binary.jsonl'}:2 is not UTF-8 text (its byte 1 is 0x80); a jsonl "
        "input must be UTF-8 JSON lines: convert it (iconv -t UTF-8) or leave it out (--exclude)"], result.stderr
    assert sorted(os.listdir(tmp_path)) == ["binary.jsonl", "good.jsonl"]


def test_inputs_and_tokenizers_that_cannot_be_read_are_one_line(tmp_path, capsys):
    """A parquet file that is not parquet; a tokenizer.json that is not UTF-8, or a directory."""
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 but not really")
    message = run_error([str(tmp_path / "fake.parquet"), "--output", str(tmp_path / "out.zarr")], capsys)
    assert f"{tmp_path / 'fake.parquet'} is not a readable parquet file: " in message, message
    args = write_inputs(tmp_path / "in", "jsonl") + ["--output", str(tmp_path / "out.zarr"), "--tokenizer"]
    (tmp_path / "latin1.json").write_bytes(b'{"model": "caf\xe9"}')
    message = run_error(args + [str(tmp_path / "latin1.json")], capsys)
    assert message.endswith("is not UTF-8 text (its byte 14 from the start is 0xe9); a tokenizer.json is UTF-8 JSON")
    message = run_error(args + [str(tmp_path / "in")], capsys)
    assert message.startswith(f"prepare_dataset: error: cannot read tokenizer file {str(tmp_path / 'in')!r}: "
                              "Is a directory"), message
    assert not os.path.exists(tmp_path / "out.zarr")


def test_vocab_smaller_than_the_data_stops_training(tmp_path):
    """train.train, as `python -m train` runs it (which prints the error as its one line: see
    tests/test_train_cli.py), refuses the prepared data with a vocabulary too small for it."""
    out = str(tmp_path / "text.zarr")
    run(write_inputs(tmp_path / "in", "jsonl") + ["--output", out, "--validation-documents", "2"])
    cfg = load_config("local_test_text", ["+paths.model_name=vocab", f"paths.root_working_dir={tmp_path}",
                                          f"dataset.path={out}", "model.vocab=256"])
    with pytest.raises(ConfigError, match=r"model.vocab=256 is too small for the dataset's max_token_id 257"):
        train.train(cfg, "unused: true\n")
    assert not os.path.exists(tmp_path / "vocab")


def test_an_output_on_a_read_only_disk_is_one_line(tmp_path, capsys):
    """A read-only disk under --output: one line naming the path and the cause, exit 2 (was: a 40-line
    OSError traceback from zarr)."""
    text = tmp_path / "text.txt"
    text.write_text("a document\n")
    with mounted(tmp_path / "disk", "ro") as disk:
        with pytest.raises(SystemExit) as exit:
            prepare_dataset.main([str(text), "--output", str(disk / "data.zarr"), "--workers", "1", "--quiet"])
        assert exit.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"prepare_dataset: error: cannot write dataset '{disk}/data.zarr.tmp-") and lines[0].endswith(
            ": Read-only file system; write it where you may (another --output)"), lines
        assert os.listdir(disk) == []
