"""tools/prepare_dataset.py --validation-inputs: the validation split is exactly the documents of
the given files (text, jsonl and parquet alike), and train exactly those of the inputs."""

import json
import os

import numpy as np
import pytest

from fixtures import decoded, make_mesh, tiny_config
from seqax.data import evaluation
from seqax.data.flat_tokens import open_flat_tokens
from seqax.data.tokenizer import dataset_tokenizer
from tools import prepare_dataset

TRAIN = [f"training document {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(12)]
HELD_OUT = {  # validation documents by input format
    "txt": ["a held-out text file, one document"],
    "jsonl": ["held-out jsonl line one", "held-out jsonl line two, naïve café"],
    "parquet": ["held-out parquet row one", "held-out parquet row two", "日本語の検証"],
}


def write_files(folder) -> tuple[list[str], list[str]]:
    """(training inputs, validation files): TRAIN as text files in one folder; HELD_OUT in one
    file of each format in another."""
    import pyarrow
    import pyarrow.parquet

    train_dir, held_dir = folder / "train", folder / "held"
    train_dir.mkdir()
    held_dir.mkdir()
    for i, d in enumerate(TRAIN):
        (train_dir / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
    (held_dir / "a.txt").write_text(HELD_OUT["txt"][0], encoding="utf-8")
    (held_dir / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in HELD_OUT["jsonl"]),
                                      encoding="utf-8")
    pyarrow.parquet.write_table(pyarrow.table({"text": HELD_OUT["parquet"]}), str(held_dir / "c.parquet"))
    return [str(train_dir)], [str(held_dir / name) for name in ("a.txt", "b.jsonl", "c.parquet")]


def run(argv):
    prepare_dataset.main(argv + ["--quiet"])


@pytest.mark.parametrize("workers", [1, 2])
def test_validation_split_is_exactly_the_validation_inputs(tmp_path, workers):
    inputs, held = write_files(tmp_path)
    out = str(tmp_path / "out.zarr")
    run(inputs + ["--validation-inputs", *held, "--output", out, "--workers", str(workers)])
    splits = decoded(out)
    assert splits["validation"] == HELD_OUT["txt"] + HELD_OUT["jsonl"] + HELD_OUT["parquet"]
    assert splits["train"] == TRAIN
    assert open_flat_tokens(out).attrs["validation"] == {"inputs": held}


def test_max_tokens_cuts_the_inputs_not_the_validation_files(tmp_path):
    inputs, held = write_files(tmp_path)
    out = str(tmp_path / "out.zarr")
    run(inputs + ["--validation-inputs", *held, "--output", out, "--workers", "1",
                  "--max-tokens", str(len(TRAIN[0]) + 1 + 3)])  # + 1: its end-of-document id
    splits = decoded(out)
    assert splits["validation"] == HELD_OUT["txt"] + HELD_OUT["jsonl"] + HELD_OUT["parquet"]
    assert splits["train"] == [TRAIN[0], TRAIN[1][:3]]


def one_error(argv, capsys) -> str:
    """The error line of a run that stops with exit status 2 (argparse's comes after its usage)."""
    with pytest.raises(SystemExit) as exit_info:
        run(argv + ["--workers", "1"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "error: " in lines[-1]
    return lines[-1]


def test_a_file_in_both_is_refused(tmp_path, capsys):
    inputs, held = write_files(tmp_path)
    both = os.path.join(inputs[0], "doc03.txt")
    line = one_error(inputs + ["--validation-inputs", held[0], both, "--output", str(tmp_path / "out.zarr")], capsys)
    assert line.startswith("prepare_dataset: error: ") and "doc03.txt" in line and "both" in line
    assert not os.path.exists(tmp_path / "out.zarr")


def test_validation_inputs_exclude_the_other_validation_choices(tmp_path, capsys):
    inputs, held = write_files(tmp_path)
    line = one_error(inputs + ["--validation-inputs", *held, "--validation-documents", "2",
                               "--output", str(tmp_path / "out.zarr")], capsys)
    assert "at most one of" in line


def test_empty_validation_files_are_one_error(tmp_path, capsys):
    inputs, _ = write_files(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    line = one_error(inputs + ["--validation-inputs", str(empty), "--output", str(tmp_path / "out.zarr")], capsys)
    assert line.startswith("prepare_dataset: error: ") and "validation split would be empty" in line


def test_a_runs_evaluation_batches_hold_only_the_validation_documents(tmp_path):
    """What eval_loss averages over (evaluation.validation_batches, as a run reads them): every
    document piece in them is text of a validation file, none of a training input."""
    inputs, held = write_files(tmp_path)
    out = str(tmp_path / "out.zarr")
    run(inputs + ["--validation-inputs", *held, "--output", out])
    cfg = tiny_config(f"dataset.path={out}", "model.vocab=512", "eval_batches=2", "training.tokens.batch=4",
                      "training.tokens.len=64")
    tokenizer = dataset_tokenizer(out)
    pieces = []
    for batch in evaluation.validation_batches(cfg, open_flat_tokens(out), make_mesh(1, 1)):
        targets, starts, mask = (np.asarray(a) for a in (batch.targets, batch.is_seq_start, batch.loss_mask))
        for row in range(targets.shape[0]):
            cuts = [i for i in range(targets.shape[1]) if starts[row, i]] + [targets.shape[1]]
            pieces += [tokenizer.decode(targets[row, a:b][mask[row, a:b]]) for a, b in zip([0] + cuts, cuts) if b > a]
    long_pieces = [p for p in pieces if len(p) >= 8]
    assert len("".join(long_pieces)) > 300, pieces  # two batches of 4 x 64 tokens: mostly long pieces
    validation_text = "\n".join(HELD_OUT["txt"] + HELD_OUT["jsonl"] + HELD_OUT["parquet"])
    assert all(p in validation_text and not any(p in d for d in TRAIN) for p in long_pieces), long_pieces
