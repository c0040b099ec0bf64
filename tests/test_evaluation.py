"""Evaluation (evaluation.py). The validation loss: eval_loss lines at the right steps, the same values
after a restart on another mesh, and equal to the reference loss (tests/reference.py) of the same
validation batches. Multiple-choice tasks: a task file's faults stop a run before its first step
with one line; packed choices score what the independent reference model scores one document at a
time; and on a trained run, the loop's accuracies agree with lm-evaluation-harness on the exported
model, example by example."""

import email
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from functools import partial

import jax
import numpy as np
import pytest
import yaml

import reference
import train
from fixtures import (
    make_mesh,
    prepared_dataset,
    reference_config,
    run_train,
    synthetic_dataset,
    tiny_config,
    tiny_overrides,
    train_args,
)
from reference import loss as reference_loss
from reference import sequence_losses, weights_to_dicts
from seqax import runs
from seqax.config import Config, ConfigError, config_from_dict
from seqax.data import evaluation
from seqax.data.data_loader import make_loader
from seqax.data.flat_tokens import open_flat_tokens
from seqax.data.tokenizer import ByteTokenizer, JsonTokenizer
from seqax.shardlib.shardtypes import make_shardings
from tools import export_hf, lm_eval_task, make_choice_task


def write_task(path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


GOOD = json.dumps({"context": "x = 1\n", "choices": ["y = 2", "z"], "label": 0})


@pytest.mark.parametrize("line,message", [
    ("{not json", r"line 2 is not JSON"),
    (json.dumps({"context": "a", "choices": ["b"], "label": 0}), r"line 2 must be .*two or more non-empty str"),
    (json.dumps({"context": "a", "choices": ["b", ""], "label": 0}), r"line 2 must be"),
    (json.dumps({"context": "a", "choices": ["b", "c"], "label": "0"}), r"line 2 must be"),
    (json.dumps({"context": "a", "choices": ["b", "c"], "label": 2}), r"line 2: label 2 is out of range for 2 choices"),
    (json.dumps({"context": 3, "choices": ["b", "c"], "label": 0}), r"line 2 must be"),
])
def test_a_malformed_line_is_named_by_file_and_line(tmp_path, line, message):
    path = write_task(tmp_path / "task.jsonl", GOOD, line)
    with pytest.raises(ConfigError, match=rf"evaluation task {path}, {message}"):
        evaluation.read_examples(path)


def test_a_line_that_is_not_utf8_is_named_by_file_line_and_byte(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"context": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=rf"^evaluation task {path}, line 2 is not UTF-8 text "
                                          r"\(its byte 17 is 0xe9\); a task file is UTF-8 JSONL"):
        evaluation.read_examples(str(path))


@pytest.mark.slow
def test_a_task_file_that_is_not_utf8_stops_the_command_with_one_line(tmp_path):
    """`python -m train` with a binary task file (was: a 26-line UnicodeDecodeError traceback)."""
    dataset = prepared_dataset(tmp_path / "data.zarr", os.path.dirname(email.__file__), "--suffixes", ".py",
                               "--validation-documents", "2")
    task = tmp_path / "binary.jsonl"
    task.write_bytes(bytes(range(128, 256)) * 4 + b"\n")
    overrides = tiny_overrides("model.vocab=264", "training.tokens.len=64", f"evaluation.tasks=[{task}]")
    result = run_train(train_args(tmp_path, dataset, "run", *overrides), graph=False)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"seqax: error: evaluation task {task}, line 1 is not UTF-8 text (its byte 1 is 0x80); a task file is "
        "UTF-8 JSONL: convert it (iconv -t UTF-8) or fix that line"], result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_text_the_tokenizer_cannot_encode_is_named_by_example(tmp_path):
    """A tokenizer.json without the characters of a task (a word-level vocabulary with [UNK]) would
    read other text: the example is named; the bytes tokenizer encodes anything."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"x": 0, "=": 1, "1": 2, "[UNK]": 3}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = JsonTokenizer(word_level.to_str(), "test")
    with pytest.raises(ConfigError, match=r"example 3: the dataset's tokenizer cannot encode"):
        evaluation.choice_documents(tokenizer, "x = 1", " é", "example 3")
    document, first = evaluation.choice_documents(ByteTokenizer(), "x = 1 ", "é", "example 3")
    assert list(document - 1) == list("x = 1 é".encode()) and first == len("x = 1")  # the space goes with the choice


def test_a_bad_task_file_stops_the_run_before_anything_is_written(tmp_path):
    """What `python -m train` runs, in this process: a task file with a label out of range, or one
    that is missing, stops train.train with the file and line named; the run directory is not made."""
    dataset = prepared_dataset(tmp_path / "data.zarr", os.path.dirname(email.__file__), "--suffixes", ".py",
                               "--validation-documents", "2")
    bad = write_task(tmp_path / "bad.jsonl", GOOD, json.dumps({"context": "a", "choices": ["b", "c"], "label": 5}))
    for path, message in ((bad, rf"evaluation task {bad}, line 2: label 5 is out of range"),
                          (str(tmp_path / "none.jsonl"), "is not a file")):
        cfg = tiny_config(f"dataset.path={dataset}", "model.vocab=264", "training.tokens.len=64",
                          f"paths.root_working_dir={tmp_path}", f"evaluation.tasks=[{path}]")
        with pytest.raises(ConfigError, match=message):
            train.train(cfg, "unused: true\n")
    assert not (tmp_path / "test").exists()


@pytest.mark.slow  # about 6 s: the reference, jitted, document by document
def test_packed_choices_score_what_the_reference_scores_document_by_document(tmp_path, monkeypatch):
    """On the tiny model (float32 matmuls, so that only the order of sums differs), mesh 4x2 and
    rows of 64 bytes: each choice's log-likelihood from the packed batches equals the sum of
    tests/reference.py's losses over the choice's bytes, the document (0, context, choice) run
    alone; accuracies follow from the same numbers."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "x", "(y)", "é"]
    lines = [json.dumps({"context": " ".join(rng.choice(words, rng.integers(1, 6))) + rng.choice(["", " ", "\n"]),
                         "choices": [" ".join(rng.choice(words, rng.integers(1, 4))) for _ in range(3)],
                         "label": int(rng.integers(3))}) for _ in range(12)]
    path = write_task(tmp_path / "words.jsonl", *lines)
    cfg = tiny_config("model.vocab=264", "training.tokens.len=64", "model.matmul_dtype=float32")
    mesh = make_mesh(4, 2)
    weights = train.init_weights(cfg.model, jax.random.key(0))
    monkeypatch.setattr(reference, "bf16", jax.numpy.float32)  # the reference's matmuls in float32 too
    with jax.set_mesh(mesh):
        task = evaluation.load_task(path, ByteTokenizer(), cfg, mesh)
        placed = jax.device_put(weights, make_shardings(train.Model, mesh))
        ours = evaluation.log_likelihoods(partial(train.eval_step, placed, cfg=cfg), task, mesh)
    assert len(task.batches) >= 2 and sum(len(p) for p in task.places) == 36  # several documents a row, two batches
    w = jax.tree.map(jax.numpy.asarray, weights_to_dicts(jax.device_get(weights), cfg.model.layers))
    ref_cfg = reference_config(cfg.model)
    alone = jax.jit(lambda tokens, starts: sequence_losses(w, ref_cfg, tokens, starts)[0])
    for (context, choices, _), loglik in zip(evaluation.read_examples(path), ours):
        for choice, got in zip(choices, loglik):
            document, first = evaluation.choice_documents(ByteTokenizer(), context, choice, "")
            # The document first in a row of its own, then padding (each position a document), which it cannot see.
            tokens, starts = np.zeros(64, np.uint32), np.ones(64, bool)
            tokens[: len(document)], starts[1 : len(document)] = document, False
            want = -float(np.sum(np.asarray(alone(tokens, starts))[first : len(document)], dtype=np.float64))
            assert got == pytest.approx(want, rel=1e-5), (context, choice)


@pytest.mark.slow
def test_the_loops_accuracy_agrees_with_lm_eval_on_the_export(tmp_path):
    """local_test_text on the source of the standard library's email package (bytes), 30 steps of 8
    rows, a 60-example task of which line comes next (tools/make_choice_task.py) scored in the loop.
    Then the export, tools/lm_eval_task.py's YAML and `lm_eval` offline, as docs/export.md says. Every
    example: the choice lm-eval's acc and acc_norm pick is the one evaluation.py picks (at least 99%
    of them: float32 against bf16 matmuls may break a near-tie), and each choice's log-likelihood
    within 2% of lm-eval's (5 units of bf16's 2^-8 rounding; measured on the full text run: 0.5%)."""
    dataset = prepared_dataset(tmp_path / "email.zarr", os.path.dirname(email.__file__), "--suffixes", ".py",
                               "--validation-documents", "4")
    task = str(tmp_path / "email_lines.jsonl")
    make_choice_task.main(["--dataset", dataset, "--output", task, "--examples", "60"])
    args = ["--config-name=local_test_text", "+paths.model_name=run", f"paths.root_working_dir={tmp_path}",
            f"dataset.path={dataset}", "training.steps=30", "training.warmup_steps=6", "training.tokens.batch=8",
            "eval_interval=30", "checkpoint_interval=0", f"evaluation.tasks=[{task}]"]
    result = run_train(args, graph=False)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [line for line in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "eval_loss" in line]
    assert [line["step"] for line in logged] == [30] and "evaluation every 30 steps" in result.stdout

    # The loop's numbers, example by example: the same code, on the run's final weights.
    run_dir = str(tmp_path / "run")
    cfg = config_from_dict(Config, yaml.safe_load(open(os.path.join(run_dir, "config.yaml"))))
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t)
    with jax.set_mesh(mesh):
        ours_task = evaluation.load_task(task, ByteTokenizer(), cfg, mesh)
        _, weights = runs.load_weights(run_dir, runs.load_run_config(run_dir), mesh, train.init_weights,
                                        train.Model)
        ours = evaluation.log_likelihoods(partial(train.eval_step, weights, cfg=cfg), ours_task, mesh)
    labels = np.array(ours_task.labels)
    picks = np.array([np.argmax(ll) for ll in ours])
    picks_norm = np.array([np.argmax(ll / np.array(c)) for ll, c in zip(ours, ours_task.choice_chars)])
    assert logged[0]["email_lines/acc"] == pytest.approx(np.mean(picks == labels))
    assert logged[0]["email_lines/acc_norm"] == pytest.approx(np.mean(picks_norm == labels))

    export_hf.main(["--run-dir", run_dir, "--output", str(tmp_path / "hf")])
    lm_eval_task.main([task, "--output", str(tmp_path / "lm_tasks")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "hf", "--model_args",
               f"pretrained={tmp_path / 'hf'},dtype=float32", "--include_path", str(tmp_path / "lm_tasks"),
               "--tasks", "email_lines", "--device", "cpu", "--batch_size", "16", "--output_path",
               str(tmp_path / "lm_out"), "--log_samples"]
    done = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = glob.glob(str(tmp_path / "lm_out" / "*" / "samples_email_lines_*.jsonl"))
    samples = sorted(map(json.loads, open(samples)), key=lambda s: s["doc_id"])
    theirs = [np.array([float(r[0]) for r in s["filtered_resps"]]) for s in samples]
    assert len(theirs) == len(ours) == 60
    for mine, lm, name in ((picks, [np.argmax(ll) for ll in theirs], "acc"),
                           (picks_norm, [np.argmax(ll / np.array(c)) for ll, c in zip(theirs, ours_task.choice_chars)],
                            "acc_norm")):
        agree = np.mean(mine == np.array(lm))
        print(f"{name}: the loop and lm-eval pick the same choice on {agree:.1%} of {len(mine)} examples")
        assert agree >= 0.99, (name, agree)
        lm_metric = np.mean([s[name] for s in samples])
        assert abs(lm_metric - np.mean(mine == labels)) <= 1 - agree + 1e-9  # the aggregate follows
    relative = np.concatenate([np.abs(a - b) / np.abs(b) for a, b in zip(ours, theirs)])
    print(f"log-likelihoods: largest relative difference {relative.max():.2e}, median {np.median(relative):.2e}")
    assert relative.max() <= 0.02, relative.max()


# ---------------------------------------------------------------------------------------------
# The validation loss.


@pytest.fixture(scope="module")
def validation_dataset(tmp_path_factory) -> str:
    return synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic.zarr", "--train-tokens", "20000",
                             "--validation-tokens", "3000")


def eval_overrides(d: int, t: int) -> list[str]:
    return tiny_overrides("model.n_kv=2", "dataset.streams=1", "training.steps=6", "checkpoint_interval=2",
                          "checkpoints.keep=0", "eval_interval=4", "eval_batches=2", f"mesh.d={d}", f"mesh.t={t}")


def train_on(dataset: str, root, d: int, t: int, float32: bool = False):
    """`python -m train` on a (d, t) mesh, in a child process (profiler, threads and all; no
    training_step.svg, which nothing here reads: fixtures.child_env), its matmuls in float32 if `float32`
    (fixtures.train_command)."""
    result = run_train(train_args(root, dataset, "eval", *eval_overrides(d, t)), graph=False, float32=float32)
    assert result.returncode == 0, result.stderr[-3000:]


def eval_lines(run_dir) -> list[dict]:
    return [line for line in map(json.loads, open(run_dir / "metrics.jsonl")) if "eval_loss" in line]


@pytest.mark.slow  # two training runs
def test_eval_loss_steps_restart_mesh_and_reference(validation_dataset, tmp_path, monkeypatch):
    """Evaluations at eval_interval and after the last step; a restart from checkpoint 2 on another mesh
    evaluates at the same steps with the same losses, within 1e-6 (matmuls in float32: in bf16 four steps on
    another mesh drift by a few 1e-4, test_optimizer's test_training_steps_agree_on_every_mesh; measured
    8.4e-8); the last is the mean loss of validation batches 0 and 1 by the reference, in float32 too, within
    1e-6 (measured 4.4e-8)."""
    dataset = validation_dataset
    train_on(dataset, tmp_path, 4, 2, float32=True)
    run_dir = tmp_path / "eval"
    first = eval_lines(run_dir)
    assert [line["step"] for line in first] == [4, 6]  # every eval_interval steps and after the last

    # Restart from checkpoint 2 on another mesh: steps 2..5 run again, and so do both evaluations.
    for step in (4, 6):
        shutil.rmtree(run_dir / "checkpoints" / f"{step:010d}")
    train_on(dataset, tmp_path, 8, 1, float32=True)
    again = eval_lines(run_dir)[2:]
    assert [line["step"] for line in again] == [4, 6]
    for a, b in zip(first, again):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-6 * abs(a["eval_loss"]), (a, b)

    # The final weights' eval_loss is the mean loss of validation batches 0 and 1, by the reference.
    cfg8 = tiny_config(f"dataset.path={dataset}", *eval_overrides(8, 1))
    mesh = make_mesh(8, 1)
    step, weights = runs.load_weights(str(run_dir), runs.load_run_config(str(run_dir)), mesh,
                                    train.init_weights, train.Model)
    assert step == 6
    loader = make_loader(cfg8.dataset, open_flat_tokens(dataset), "validation", cfg8.training.tokens.batch,
                         cfg8.training.tokens.len, mesh)
    batches = [jax.device_get(vars(loader.batch(i))) for i in range(2)]
    loader.close()
    reference_cfg = reference_config(cfg8.model)
    weights = weights_to_dicts(jax.device_get(weights), cfg8.model.layers)
    monkeypatch.setattr(reference, "bf16", jax.numpy.float32)  # the reference's matmuls in float32 too
    losses = [jax.jit(lambda w, b=b: reference_loss(w, reference_cfg, b["targets"], b["is_seq_start"],
                                                    b["loss_mask"]))(weights) for b in batches]
    expected = float(np.mean(losses))
    assert abs(again[1]["eval_loss"] - expected) <= 1e-6 * expected, (again[1]["eval_loss"], expected)


@pytest.mark.slow  # three runs, the last two without a training step
def test_an_evaluation_that_a_kill_left_undone_runs_on_resume_once(validation_dataset, tmp_path):
    """A run killed after checkpoint N committed and before evaluation N was logged (at eval_interval,
    or the final one: the rerun found checkpoint N = training.steps and exited without it) left
    metrics.jsonl without that line. The next start evaluates each committed checkpoint whose
    evaluation is due and missing, with the values it would have had; the start after adds nothing."""
    train_on(validation_dataset, tmp_path, 4, 2)  # checkpoints 2, 4 and 6; evaluations after steps 4 and 6
    metrics = tmp_path / "eval" / "metrics.jsonl"
    first = eval_lines(tmp_path / "eval")
    assert [line["step"] for line in first] == [4, 6]
    # What a kill in that window leaves on disk, for both evaluations (4's as an older run's would have).
    metrics.write_text("".join(line for line in open(metrics) if "eval_loss" not in line))
    trained = metrics.read_text()
    train_on(validation_dataset, tmp_path, 4, 2)
    assert metrics.read_text().startswith(trained)  # no step ran again
    again = [json.loads(line) for line in metrics.read_text()[len(trained):].splitlines()]
    assert [line["step"] for line in again] == [4, 6]
    # The same weights and batches: the same losses.
    assert [line["eval_loss"] for line in again] == [line["eval_loss"] for line in first]
    done = metrics.read_text()
    train_on(validation_dataset, tmp_path, 4, 2)
    assert metrics.read_text() == done


@pytest.mark.slow  # two training runs
def test_a_catch_up_evaluation_whose_checkpoint_is_damaged_is_skipped_with_one_warning(validation_dataset, tmp_path):
    """Evaluation 4 left undone by a kill, and checkpoint 4 damaged since (a byte of a chunk flipped), while
    checkpoint 6 is intact: the resume warns once that evaluation 4 is lost and trains on from 6 (it stopped
    with exit 2 and a line that gave no way out)."""
    train_on(validation_dataset, tmp_path, 4, 2)  # checkpoints 2, 4 and 6; evaluations after steps 4 and 6
    run_dir = tmp_path / "eval"
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(line for line in open(metrics)
                               if not ("eval_loss" in json.loads(line) and json.loads(line)["step"] == 4)))
    checkpoint = run_dir / "checkpoints" / "0000000004"
    chunk = max((p for p in checkpoint.glob("weights.*/**/*") if p.is_file() and p.name != "zarr.json"),
                key=lambda p: p.stat().st_size)  # the evaluation reads the weights alone
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    result = run_train(train_args(tmp_path, validation_dataset, "eval", *eval_overrides(4, 2), "training.steps=8"),
                       graph=False)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "damaged" in line]
    assert len(warnings) == 1 and re.fullmatch(
        rf"seqax: warning: checkpoint {checkpoint} is damaged \(.+\); its evaluation is skipped \(lost\) and "
        r"training goes on from checkpoint 6", warnings[0]), warnings
    lines = [json.loads(line) for line in open(metrics)]
    assert [line["step"] for line in eval_lines(run_dir)] == [6, 8]
    assert [line["step"] for line in lines if "loss" in line][-2:] == [6, 7]


@pytest.mark.slow  # two training runs
def test_a_resume_reads_past_bytes_in_metrics_jsonl_that_are_not_utf8(validation_dataset, tmp_path):
    """A line of bytes that are not UTF-8 in metrics.jsonl (a disk error, an editor): every resume stopped with an
    80-line UnicodeDecodeError until it was fixed by hand; now the line is no JSON, and the run goes on."""
    train_on(validation_dataset, tmp_path, 4, 2)
    metrics = tmp_path / "eval" / "metrics.jsonl"
    with open(metrics, "ab") as f:
        f.write(b"\xff\xfe garbage\n")
    result = run_train(train_args(tmp_path, validation_dataset, "eval", *eval_overrides(4, 2), "training.steps=8"),
                       graph=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [json.loads(line)["step"] for line in open(metrics, errors="replace") if "eval_loss" in line] == [4, 6, 8]
