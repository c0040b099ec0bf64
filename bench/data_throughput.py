"""Data pipeline figures on this machine: prepare_dataset tokens/s (bytes and BPE tokenizers) and
the loader's sustained tokens/s against what a training step of a config consumes.

    .venv/bin/python -m bench.data_throughput [--config local_test_text] [--steps 300]
        [--train-metrics runs/local_text/metrics.jsonl | --step-seconds S]

The text is the Python standard library's source (as `make text_dataset.zarr` prepares it). The
training step's consumption is the median step time of a run's metrics.jsonl (steps after the
first two) or --step-seconds; bench/throughput.py measures it for any config.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import train  # noqa: E402
from seqax.config import DatasetConfig  # noqa: E402
from seqax.data.data_loader import make_loader  # noqa: E402
from seqax.data.flat_tokens import open_flat_tokens  # noqa: E402
from tools import prepare_dataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB = [sysconfig.get_paths()["stdlib"], "--suffixes", ".py", "--exclude", "*/site-packages/*", "*/test/*",
          "*/tests/*", "*/idle_test/*"]


def prepare(output: str, extra: list[str]) -> dict:
    args = prepare_dataset.parse_args(STDLIB + ["--output", output, "--validation-documents", "20", "--quiet"] + extra)
    return prepare_dataset.prepare(args)


def train_bpe(path: str, vocab: int) -> float:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = prepare_dataset.find_files(STDLIB[:1], (".py",), STDLIB[4:])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    start = time.perf_counter()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tokenizer.train(files, trainer)
    tokenizer.save(path)
    return time.perf_counter() - start


def loader_rates(settings: DatasetConfig, batch: int, length: int, steps: int, step_seconds: float | None):
    dataset = open_flat_tokens(settings.path)
    mesh = train.make_mesh(4, 2)
    tokens = steps * batch * length
    plain = make_loader(dataclasses.replace(settings, prefetch=0), dataset, "train", batch, length, mesh)
    start = time.perf_counter()
    for s in range(steps):
        plain.local_batch(s)
    host = tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    for s in range(steps, 2 * steps):
        jax.block_until_ready(plain.batch(s).targets)
    device = tokens / (time.perf_counter() - start)
    fresh = make_loader(settings, dataset, "train", batch, length, mesh)
    start = time.perf_counter()
    jax.block_until_ready(fresh.batch(1_000_000).targets)
    jump = time.perf_counter() - start
    fresh.close()
    plain.close()
    print(f"loader: host rows {host:,.0f} tokens/s; with device assembly {device:,.0f} tokens/s "
          f"(prefetch 0, {steps} steps of {batch}x{length}, epoch {plain.epoch(2 * steps)})")
    print(f"loader: batch(1_000_000) on a fresh loader {jump * 1e3:.1f} ms")
    if step_seconds:
        overlapped = make_loader(settings, dataset, "train", batch, length, mesh)
        waits = []
        for s in range(min(steps, 40)):
            start = time.perf_counter()
            jax.block_until_ready(overlapped.batch(s).targets)
            waits.append(time.perf_counter() - start)
            time.sleep(step_seconds)  # the training step the prefetch overlaps with
        overlapped.close()
        need = batch * length / step_seconds
        print(f"training step: {step_seconds:.3f} s = {need:,.0f} tokens/s consumed; "
              f"the loader alone is {device / need:,.0f}x faster")
        print(f"with prefetch {settings.prefetch} behind a {step_seconds:.3f} s step: "
              f"batch() waits median {statistics.median(waits[1:]) * 1e3:.1f} ms, "
              f"max {max(waits[1:]) * 1e3:.1f} ms ({statistics.median(waits[1:]) / step_seconds:.2%} of a step)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="local_test_text")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--train-metrics", default=os.path.join(ROOT, "runs", "local_text", "metrics.jsonl"))
    p.add_argument("--step-seconds", type=float)
    p.add_argument("--bpe-vocab", type=int, default=4096)
    args = p.parse_args()
    print(f"{os.cpu_count()} cores; jax {jax.__version__}; numpy {np.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        info = prepare(os.path.join(tmp, "bytes.zarr"), [])
        tokens = info["train_tokens"] + info["validation_tokens"]
        print(f"prepare_dataset, bytes tokenizer: {tokens:,} tokens in {info['seconds']:.2f} s = "
              f"{info['tokens_per_second']:,.0f} tokens/s")
        seconds = train_bpe(os.path.join(tmp, "bpe.json"), args.bpe_vocab)
        info = prepare(os.path.join(tmp, "bpe.zarr"), ["--tokenizer", os.path.join(tmp, "bpe.json")])
        tokens = info["train_tokens"] + info["validation_tokens"]
        print(f"prepare_dataset, BPE tokenizer (vocab {args.bpe_vocab}, trained in {seconds:.1f} s): "
              f"{tokens:,} tokens in {info['seconds']:.2f} s = {info['tokens_per_second']:,.0f} tokens/s")
        yaml = OmegaConf.load(os.path.join(ROOT, "configs", f"{args.config}.yaml"))
        settings = DatasetConfig(**{**OmegaConf.to_container(yaml.dataset), "path": os.path.join(tmp, "bytes.zarr")})
        step_seconds = args.step_seconds
        if step_seconds is None and os.path.exists(args.train_metrics):
            with open(args.train_metrics) as f:
                times = [line["step_time"] for line in map(json.loads, filter(str.strip, f))
                         if "step_time" in line][2:]  # not eval lines
            step_seconds = statistics.median(times) if times else None
        if step_seconds is None:
            print(f"no training step time: run `make train-text` (it writes {args.train_metrics}) "
                  "or pass --step-seconds", file=sys.stderr)
        loader_rates(settings, yaml.training.tokens.batch, yaml.training.tokens.len, args.steps, step_seconds)


if __name__ == "__main__":
    main()
