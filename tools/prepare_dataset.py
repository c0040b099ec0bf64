"""Tokenizes text into a flat-tokens dataset (docs/flat-tokens.md) with train and validation splits.

    python -m tools.prepare_dataset INPUT... --output DATASET.zarr [--tokenizer bytes|tokenizer.json|HUB_NAME]
    python -m tools.prepare_dataset --hf-dataset NAME [--hf-config C] [--hf-split train] --output ...

Inputs are files or directories (searched recursively, sorted, for files ending in --suffixes),
less the paths that match an --exclude pattern:
  *.jsonl / *.json  one JSON object per line; the document is its --text-field
  *.parquet         the --text-field column, one document per row
  anything else     text (UTF-8; undecodable bytes become U+FFFD). With --txt-documents file
                    (the default) a file is one document; with `paragraph` each run of
                    non-blank lines is one document (cut at lines holding only whitespace;
                    the line break before a blank line is not part of the document).
  --hf-dataset      a Hugging Face dataset, read with `datasets` in streaming mode.
Empty documents are skipped. Documents keep their input order in each split, except that with
--validation-documents a train document may come later (it was held as a validation candidate).

Tokenizers (tokenizer.py): `bytes` (UTF-8 bytes, vocabulary 258, no download; the default)
or a `tokenizers` tokenizer.json. Ids are stored +1 (0 is the model's begin-of-document input).

Validation: document number i (counting from 0 in input order) goes to validation when its
keyed hash blake2b("<seed>:<i>") falls in the lowest --validation-fraction of the hash range,
or, with --validation-documents N, when it is among the N documents with the lowest hashes. The
choice depends only on the seed and the document's position, not on the tokenizer. With
--validation-inputs FILE... instead, validation is every document of those files (text, jsonl or
parquet, as inputs are read; --max-tokens does not cut them) and train every document of the
inputs: no validation document comes from the inputs, and no file may be in both.

Tokenization runs in --workers processes (default: all cores; 1: in this process) with a
progress bar in tokens/s.
--max-tokens stops after that many tokens in all (the last document is cut there). The dataset
is written under a temporary name and renamed into place when complete; an existing output is
replaced only with --overwrite.
"""

import argparse
import contextlib
import fnmatch
import glob
import hashlib
import heapq
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

from seqax.config import DatasetError, SeqaxError
from seqax.data.flat_tokens import FlatTokensWriter
from seqax.data.tokenizer import from_spec, load_tokenizer
from seqax.optional import require
from seqax.outputs import check_output_apart

BATCH_CHARS = 1 << 20  # text sent to a worker at a time


def find_files(inputs: list[str], suffixes: tuple[str, ...], exclude: list[str]) -> list[str]:
    files = []
    for name in inputs:
        if os.path.isdir(name):
            found = [os.path.join(d, f) for d, _, fs in os.walk(name) for f in fs if f.endswith(suffixes)]
            files.extend(sorted(found))
        elif os.path.isfile(name):
            files.append(name)
        else:
            matches = sorted(glob.glob(name, recursive=True))
            if not matches:
                raise DatasetError(f"input {name!r} is not a file, a directory or a pattern that matches files")
            files.extend(matches)
    return [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in exclude)]


def paragraphs(text: str) -> Iterator[str]:
    block: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.strip():
            block.append(line)
        elif block:
            yield "".join(block).rstrip("\r\n")
            block = []
    if block:
        yield "".join(block).rstrip("\r\n")


def file_documents(path: str, txt_documents: str, text_field: str) -> Iterator[str]:
    """The documents of one input file; a file that cannot be read (or decoded) stops with one line naming it."""
    try:
        yield from _file_documents(path, txt_documents, text_field)
    except OSError as e:
        raise DatasetError(f"cannot read input {path}: {e.strerror or e}") from None


def _file_documents(path: str, txt_documents: str, text_field: str) -> Iterator[str]:
    if path.endswith((".jsonl", ".json")):
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{path}:{number} is not UTF-8 text (its byte {e.start + 1} is "
                                       f"0x{raw[e.start]:02x}); a {path.rsplit('.', 1)[1]} input must be UTF-8 JSON "
                                       "lines: convert it (iconv -t UTF-8) or leave it out (--exclude)") from None
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise DatasetError(f"{path}:{number} is not JSON: {e}") from None
                    if not isinstance(record, dict) or text_field not in record:
                        raise DatasetError(f"{path}:{number} has no field {text_field!r} "
                                           "(choose one with --text-field)")
                    yield record[text_field]
    elif path.endswith(".parquet"):
        require("pyarrow", "tools.prepare_dataset on a .parquet file")
        import pyarrow.parquet
        try:
            table = pyarrow.parquet.ParquetFile(path)
            if text_field not in table.schema_arrow.names:
                raise DatasetError(f"{path} has no column {text_field!r} "
                                   f"(it has {table.schema_arrow.names}; choose one with --text-field)")
            for batch in table.iter_batches(columns=[text_field]):
                yield from (t for t in batch.column(0).to_pylist() if t is not None)
        except pyarrow.ArrowException as e:  # not parquet, or damaged
            raise DatasetError(f"{path} is not a readable parquet file: {str(e).strip().splitlines()[0]}") from None
    else:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            text = f.read()
        yield from (paragraphs(text) if txt_documents == "paragraph" else [text])


def hf_documents(args) -> Iterator[str]:
    datasets = require("datasets", "tools.prepare_dataset --hf-dataset")
    data_files = args.hf_data_files or None
    stream = datasets.load_dataset(args.hf_dataset, args.hf_config, split=args.hf_split, streaming=True,
                                   data_files=data_files)
    for record in stream:
        if args.text_field not in record:
            raise DatasetError(f"dataset {args.hf_dataset!r} has no field {args.text_field!r} "
                               f"(it has {sorted(record)}; choose one with --text-field)")
        yield record[args.text_field]


def documents(args, files: list[str] | None = None) -> Iterator[str]:
    """The non-empty documents of `files` (default: the inputs, or --hf-dataset)."""
    if files is None and args.hf_dataset:
        source = hf_documents(args)
    else:
        files = input_files(args, args.inputs) if files is None else files
        source = itertools.chain.from_iterable(file_documents(f, args.txt_documents, args.text_field) for f in files)
    return (d for d in source if d)


def input_files(args, inputs: list[str]) -> list[str]:
    return find_files(inputs, tuple(args.suffixes.split(",")), args.exclude)


def validation_files(args) -> list[str] | None:
    """The files of --validation-inputs (None without it); none may also be a training input."""
    if not args.validation_inputs:
        return None
    files = input_files(args, args.validation_inputs)
    if not files:
        raise DatasetError(f"--validation-inputs {args.validation_inputs} match no files "
                           f"(with --suffixes {args.suffixes!r} and --exclude)")
    training = set() if args.hf_dataset else {os.path.realpath(f) for f in input_files(args, args.inputs)}
    both = [f for f in files if os.path.realpath(f) in training]
    if both:
        raise DatasetError(f"{both[0]!r} is both a training input and a --validation-inputs file; "
                           "validation documents must not come from the inputs")
    return files


def text_batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_worker_tokenizer = None


def _start_worker(spec):
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = from_spec(spec)


def _encode(texts: list[str]) -> list[np.ndarray]:
    return _worker_tokenizer.encode(texts)


def document_hash(index: int, seed: int) -> int:
    """The document's keyed 64-bit hash (lower means validation first)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little")


class Splitter:
    """Routes documents to train or validation as the module docstring says."""

    def __init__(self, writer: FlatTokensWriter, seed: int, fraction: float, count: int | None):
        self.writer, self.seed, self.fraction, self.count = writer, seed, fraction, count
        # max-heap by hash of the current N lowest: (-hash, index, tokens)
        self.held: list[tuple[int, int, np.ndarray]] = []
        self.index = 0

    def add(self, docs: list[np.ndarray]):
        train, validation = [], []
        for tokens in docs:
            h = document_hash(self.index, self.seed)
            if self.count is None:
                (validation if h < self.fraction * 2.0**64 else train).append(tokens)
            elif len(self.held) < self.count:
                heapq.heappush(self.held, (-h, self.index, tokens))
            elif h < -self.held[0][0]:
                train.append(heapq.heapreplace(self.held, (-h, self.index, tokens))[2])
            else:
                train.append(tokens)
            self.index += 1
        self.writer.add_documents("train", train)
        self.writer.add_documents("validation", validation)

    def finish(self):
        self.writer.add_documents("validation", [tokens for _, _, tokens in sorted(self.held, key=lambda x: x[1])])


def inputs_read(args) -> list[tuple[str, str]]:
    """(the name the user gave, a path) of every input file or directory that the inputs and
    --validation-inputs name, patterns expanded."""
    names = [*args.inputs, *(args.validation_inputs or [])]
    return [(f"the input {name!r}", path) for name in names for path in glob.glob(name, recursive=True) or [name]]


def prepare(args) -> dict:
    check_output_apart(args.output, inputs_read(args), error=DatasetError)
    tokenizer = load_tokenizer(args.tokenizer, eos=not args.no_eos, eos_token=args.eos_token)
    held_out = validation_files(args)
    start, total = time.perf_counter(), 0
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds zarr's threads
    with FlatTokensWriter(args.output, overwrite=args.overwrite, chunk_tokens=args.chunk_tokens,
                          shard_tokens=args.shard_tokens or None, compression_level=args.compression_level) as writer, \
            (context.Pool(args.workers, initializer=_start_worker, initargs=(tokenizer.spec(),)) if args.workers > 1
             else contextlib.nullcontext()) as pool:
        from tqdm import tqdm

        # With --validation-inputs, the inputs all go to train (fraction 0) and those files to validation.
        splitter = Splitter(writer, args.seed, 0.0 if held_out else args.validation_fraction, args.validation_documents)
        progress = tqdm(total=args.max_tokens, unit="tok", unit_scale=True, disable=args.quiet, file=sys.stderr)
        encode = ((lambda docs: pool.imap(_encode, text_batches(docs))) if pool
                  else (lambda docs: map(tokenizer.encode, text_batches(docs))))
        # Validation files first: a --max-tokens stop of the inputs below leaves their batches queued.
        for docs in encode(documents(args, held_out)) if held_out else []:
            writer.add_documents("validation", docs)
            progress.update(sum(len(d) for d in docs))
        encoded = encode(documents(args))
        for docs in encoded:
            if args.max_tokens is not None:
                room = np.cumsum([0] + [len(d) for d in docs])
                keep = int(np.searchsorted(room, args.max_tokens - total, side="right")) - 1  # whole documents that fit
                docs = docs[:keep] + ([docs[keep][: args.max_tokens - total - int(room[keep])]]
                                      if keep < len(docs) else [])
                docs = [d for d in docs if len(d)]
            splitter.add(docs)
            n = sum(len(d) for d in docs)
            total += n
            progress.update(n)
            if args.max_tokens is not None and total >= args.max_tokens:
                break
        progress.close()
        if splitter.index == 0:
            raise DatasetError("the inputs hold no documents (every file is empty, or no file matched --suffixes)")
        splitter.finish()
        for name in ("train", "validation"):
            if writer.num_documents[name] == 0:
                fix = ("the --validation-inputs files hold no documents" if held_out
                       else "change --validation-fraction or -documents")
                raise DatasetError(f"the {name} split would be empty ({splitter.index} input documents in all); {fix}")
        info = {"train_tokens": writer.num_tokens["train"], "validation_tokens": writer.num_tokens["validation"],
                "train_documents": writer.num_documents["train"],
                "validation_documents": writer.num_documents["validation"]}
        source = ({"hf_dataset": args.hf_dataset, "hf_config": args.hf_config, "hf_split": args.hf_split}
                  if args.hf_dataset else {"inputs": args.inputs})
        if tokenizer.kind == "tokenizers":
            writer.add_bytes("tokenizer_json", tokenizer.json_text.encode())
        validation = {"inputs": held_out} if held_out else {"seed": args.seed, "fraction": args.validation_fraction,
                                                            "documents": args.validation_documents}
        writer.commit({"tokenizer": tokenizer.identity(), "source": source, "validation": validation, **info})
    seconds = time.perf_counter() - start
    return {**info, "seconds": seconds, "tokens_per_second": total / seconds, "max_token_id": writer.max_token_id,
            "vocab_size": tokenizer.vocab_size}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="files, directories or glob patterns")
    p.add_argument("--output", required=True, help="the flat-tokens zarr to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--suffixes", default=".txt,.jsonl,.json,.parquet",
                   help="comma-separated file endings searched in directories")
    p.add_argument("--exclude", nargs="*", default=[],
                   help="skip files whose path matches one of these patterns (fnmatch: '*/test/*')")
    p.add_argument("--txt-documents", choices=("file", "paragraph"), default="file",
                   help="a text file is one document, or one per blank-line-separated block")
    p.add_argument("--text-field", default="text",
                   help="the field (jsonl, Hugging Face) or column (parquet) holding the text")
    p.add_argument("--hf-dataset",
                   help="a Hugging Face dataset name, streamed with `datasets` (instead of INPUT files)")
    p.add_argument("--hf-config", help="its configuration name")
    p.add_argument("--hf-split", default="train", help="its split to read")
    p.add_argument("--hf-data-files", nargs="*",
                   help="data_files for load_dataset (for example with --hf-dataset json)")
    p.add_argument("--tokenizer", default="bytes", help="`bytes`, a tokenizer.json path, or a hub name when online")
    p.add_argument("--eos-token", help="a token of the tokenizer.json appended to every document")
    p.add_argument("--no-eos", action="store_true", help="append no end-of-document token")
    p.add_argument("--validation-fraction", type=float,
                   help="fraction of documents for validation (by keyed hash; default 0.01)")
    p.add_argument("--validation-documents", type=int, help="instead, exactly this many documents for validation")
    p.add_argument("--validation-inputs", nargs="+", metavar="FILE",
                   help="instead, every document of these files (or directories, patterns) for validation")
    p.add_argument("--seed", type=int, default=0, help="key of the validation choice")
    p.add_argument("--max-tokens", type=int,
                   help="stop after this many tokens of the inputs (both splits; not the --validation-inputs)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    p.add_argument("--chunk-tokens", type=int, default=1 << 16,
                   help="zarr chunk (the unit of compression and of a random read)")
    p.add_argument("--shard-tokens", type=int, default=1 << 22,
                   help="zarr shard (one file; a multiple of --chunk-tokens; 0: no sharding)")
    p.add_argument("--compression-level", type=int, default=3, help="zstd level")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if bool(args.inputs) == bool(args.hf_dataset):
        p.error("give INPUT files or --hf-dataset, not both and not neither")
    if sum(x is not None for x in (args.validation_fraction, args.validation_documents, args.validation_inputs)) > 1:
        p.error("give at most one of --validation-fraction, --validation-documents and --validation-inputs")
    args.validation_fraction = 0.01 if args.validation_fraction is None else args.validation_fraction
    if not 0 <= args.validation_fraction < 1 or (args.validation_documents is not None
                                                 and args.validation_documents < 1):
        p.error("--validation-fraction must be in [0, 1) and --validation-documents positive")
    if args.max_tokens is not None and args.max_tokens < 1 or args.workers < 1:
        p.error("--max-tokens and --workers must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        info = prepare(args)
    except SeqaxError as e:
        print(f"prepare_dataset: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.output}: {info['train_tokens']} train tokens in {info['train_documents']} documents, "
          f"{info['validation_tokens']} validation tokens in {info['validation_documents']} documents; "
          f"max token id {info['max_token_id']} (model.vocab must exceed it); "
          f"{info['tokens_per_second']:.0f} tokens/s")


if __name__ == "__main__":
    main()
