"""Evaluation during training: eval_loss on the validation split, and the accuracy of each
multiple-choice task of `evaluation.tasks`, every eval_interval steps (train.py's loop).

A task is a JSONL file, one example a line: {"context": str, "choices": [str, ...], "label": int}
(docs/evaluation.md converts HellaSwag, ARC or PIQA to it). It is scored as lm-evaluation-harness
0.4.13 scores a multiple_choice task whose target_delimiter is "" (so the exported model under
lm_eval gives the same choices; tests/test_evaluation.py checks it):
- a choice's continuation is the choice itself, with the context's trailing whitespace moved to
  its front; its tokens are those of encode(context + continuation) after the first
  len(encode(context)) (lm-eval's _encode_pair);
- the model reads the begin-of-document input 0, the context, then the continuation, as one
  document; the choice's log-likelihood is the sum of log p(token) over the continuation's tokens;
- acc: the choice of largest log-likelihood is the label; acc_norm: the choice of largest
  log-likelihood / len(choice) (characters of the choice as written) is.
Each (example, choice) is one document, packed with others into rows of the training batch's
length, and the rows into batches of its shape: every task runs on the step's shapes and the
evaluation step compiles once. Every process packs every batch (the same, deterministically) and
feeds its devices their rows.
"""

import dataclasses
import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from seqax.config import Config, ConfigError
from seqax.data.data_loader import Batch, host_batch_to_devices, make_loader, zigzag_order
from seqax.data.flat_tokens import FlatTokens
from seqax.data.tokenizer import dataset_tokenizer


@dataclasses.dataclass
class Task:
    name: str  # the file's name without .jsonl: the metrics' prefix
    labels: list[int]  # of each example
    choice_chars: list[list[int]]  # len(choice) of each example's choices (acc_norm's divisor)
    batches: list[Batch]  # the documents, packed
    places: list[list[tuple[int, int, int, int]]]  # per example, per choice: (batch, row, first, stop) of its tokens


def validation_batches(cfg: Config, dataset: FlatTokens, mesh) -> list[Batch]:
    """Validation batches 0..eval_batches-1 (none when eval_batches is 0), read once: every
    evaluation, on any mesh and after any restart, uses these same batches."""
    if not cfg.eval_batches:
        return []
    loader = make_loader(cfg.dataset, dataset, "validation", cfg.training.tokens.batch, cfg.training.tokens.len, mesh)
    try:
        return [loader.batch(i) for i in range(cfg.eval_batches)]
    finally:
        loader.close()


def read_examples(path: str) -> list[tuple[str, list[str], int]]:
    """(context, choices, label) of every line of a task file; a malformed line stops with one
    line naming the file and the line."""
    if not os.path.isfile(path):
        raise ConfigError(f"evaluation task {path!r} is not a file; evaluation.tasks lists JSONL files of "
                          '{"context": str, "choices": [str, ...], "label": int}')
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read evaluation task {path}: {e.strerror or e}") from None
    examples = []
    for number, raw in enumerate(lines, start=1):
        where = f"evaluation task {path}, line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where} is not UTF-8 text (its byte {e.start + 1} is 0x{raw[e.start]:02x}); "
                              "a task file is UTF-8 JSONL: convert it (iconv -t UTF-8) or fix that line") from None
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where} is not JSON: {e}") from None
        if (not isinstance(example, dict) or not isinstance(example.get("context"), str)
                or not isinstance(example.get("choices"), list) or len(example["choices"]) < 2
                or not all(isinstance(c, str) and c for c in example["choices"])
                or type(example.get("label")) is not int):
            raise ConfigError(f'{where} must be {{"context": str, "choices": [two or more non-empty str], '
                              f'"label": int}}, got {line.strip()[:200]!r}')
        if not 0 <= example["label"] < len(example["choices"]):
            raise ConfigError(f"{where}: label {example['label']} is out of range for "
                              f"{len(example['choices'])} choices")
        examples.append((example["context"], example["choices"], example["label"]))
    if not examples:
        raise ConfigError(f"evaluation task {path} has no examples")
    return examples


def choice_documents(tokenizer, context: str, choice: str, where: str) -> tuple[np.ndarray, int]:
    """The document of one (context, choice), as targets, and where the choice's tokens start in it."""
    spaces = len(context) - len(context.rstrip())  # lm-eval moves them to the continuation
    context, continuation = context[: len(context) - spaces], context[len(context) - spaces :] + choice
    for text in (context, context + continuation):
        if tokenizer.decode(tokenizer.text_ids(text)) != text:
            raise ConfigError(f"{where}: the dataset's tokenizer cannot encode {text[:80]!r} exactly "
                              "(it would read other text than the task's)")
    context_ids, whole = tokenizer.text_ids(context), tokenizer.text_ids(context + continuation)
    if len(whole) <= len(context_ids):
        raise ConfigError(f"{where}: choice {choice!r} adds no token to the context")
    return whole, len(context_ids)


def pack(documents: list[np.ndarray], batch: int, length: int, mesh) -> tuple[list[Batch], list[tuple]]:
    """Documents packed in order into rows of `length` (a document starts a new row when it does not
    fit in the current one), rows into batches of `batch` rows: (the batches, each document's
    (batch, row, first position, stop))."""
    rows, places, row = [], [], []
    for document in documents:
        if len(row) + len(document) > length:
            rows.append(row)
            row = []
        n = len(rows)
        places.append((n // batch, n % batch, len(row), len(row) + len(document)))
        row += [(token, i == 0) for i, token in enumerate(document)]
    rows.append(row)
    rows += [[]] * (-len(rows) % batch)
    batches = []
    for first in range(0, len(rows), batch):
        targets = np.zeros((batch, length), np.uint32)
        starts, mask = np.ones((batch, length), bool), np.zeros((batch, length), bool)  # padding
        for r, tokens in enumerate(rows[first : first + batch]):
            targets[r, : len(tokens)] = [t for t, _ in tokens]
            starts[r, : len(tokens)] = [s for _, s in tokens]
            mask[r, : len(tokens)] = True
        batches.append(host_batch_to_devices(targets, starts, mask, mesh))
    return batches, places


def load_task(path: str, tokenizer, cfg: Config, mesh) -> Task:
    length = cfg.training.tokens.len
    documents, spans, labels, chars = [], [], [], []
    for number, (context, choices, label) in enumerate(read_examples(path), start=1):
        where = f"evaluation task {path}, example {number}"
        labels.append(label)
        chars.append([len(c) for c in choices])
        for choice in choices:
            document, first = choice_documents(tokenizer, context, choice, where)
            if len(document) > length:
                raise ConfigError(f"{where}: its context and choice {choice[:40]!r} are {len(document)} tokens, more "
                                  f"than training.tokens.len={length}; shorten the context")
            documents.append(document)
            spans.append(first)
    batches, places = pack(documents, cfg.training.tokens.batch, length, mesh)
    # Keep each choice's own tokens: from where its continuation starts to the end of its document.
    flat = [(b, r, start + first, stop) for (b, r, start, stop), first in zip(places, spans)]
    per_example, i = [], 0
    for choices in chars:
        per_example.append(flat[i : i + len(choices)])
        i += len(choices)
    return Task(os.path.basename(path).removesuffix(".jsonl"), labels, chars, batches, per_example)


class Evaluation:
    """What every evaluation computes, prepared once before the first step (a bad task file stops
    the run there, with one line): eval_loss's validation batches and the tasks' packed batches."""

    def __init__(self, cfg: Config, dataset: FlatTokens, mesh):
        self.mesh, self.batches = mesh, validation_batches(cfg, dataset, mesh)
        tokenizer = dataset_tokenizer(cfg.dataset.path) if cfg.evaluation.tasks else None
        self.tasks = [load_task(path, tokenizer, cfg, mesh) for path in cfg.evaluation.tasks]
        names = [task.name for task in self.tasks]
        if len(set(names)) != len(names):
            raise ConfigError(f"evaluation.tasks has two files of one name ({names}); their metrics would mix")

    def __bool__(self) -> bool:
        return bool(self.batches or self.tasks)

    def batch_count(self) -> int:
        return len(self.batches) + sum(len(task.batches) for task in self.tasks)

    def plan(self, eval_interval: int, steps: int) -> str:
        """One line for the start-up report: what an evaluation runs and what it should cost."""
        n, every = self.batch_count(), f"every {eval_interval} steps and " if eval_interval else ""
        parts = [f"eval_loss {len(self.batches)}"] + [f"{t.name} {len(t.batches)} ({len(t.labels)} examples)"
                                                        for t in self.tasks]
        return (f"evaluation {every}after step {steps}: {n} batches of the step's shape ({', '.join(parts)}), "
                f"forward only: about {n / 3:.1f} training steps' time each")

    def __call__(self, token_losses) -> dict[str, float]:
        """The metrics of the weights that `token_losses(targets, is_seq_start) -> [B, L]` (each
        target's negative log-likelihood, laid out as the batch) evaluates."""
        metrics = {}
        if self.batches:
            losses = []
            for b in self.batches:
                nll, mask = host(self.mesh, token_losses(b.targets, b.is_seq_start), b.loss_mask)
                losses.append(float(np.sum(nll * mask) / max(np.sum(mask), 1)))
            metrics["eval_loss"] = float(np.mean(losses))
        for task in self.tasks:
            picks = np.array([(np.argmax(loglik), np.argmax(loglik / np.array(chars)))  # acc's and acc_norm's
                              for loglik, chars in zip(log_likelihoods(token_losses, task, self.mesh),
                                                       task.choice_chars)])
            right = picks == np.array(task.labels)[:, None]
            metrics[f"{task.name}/acc"], metrics[f"{task.name}/acc_norm"] = map(float, right.mean(axis=0))
        return metrics


def log_likelihoods(token_losses, task: Task, mesh) -> list[np.ndarray]:
    """Each example's log-likelihood of each of its choices (float64 sums over the choice's tokens),
    from `token_losses(targets, is_seq_start)` of the task's batches."""
    nll = [host(mesh, token_losses(b.targets, b.is_seq_start))[0] for b in task.batches]
    return [np.array([-np.sum(nll[b][r, first:stop], dtype=np.float64) for b, r, first, stop in places])
            for places in task.places]


def host(mesh, *arrays) -> list[np.ndarray]:
    """Global [B, L] arrays laid out as a batch is (data_loader.host_batch_to_devices), whole on every
    process, in row order."""
    order = np.argsort(zigzag_order(arrays[0].shape[1], mesh.shape["c"]))
    gathered = [multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else np.asarray(x)
                for x in arrays]
    return [x[:, order] for x in gathered]
