"""Writes a learnable synthetic flat-tokens dataset, deterministically from a seed.

Each document is a task token, a random string of symbols, a separator, and the answer:
  copy     the string again
  reverse  the string backwards
  sort     the symbols in increasing order
  shift    each symbol plus one (wrapping around the alphabet)
The answers are fully predictable, so a model that learns the tasks drives their loss to zero.

    python -m tools.write_synthetic_dataset --output synthetic_dataset.zarr
"""

import argparse

import numpy as np

from seqax.data.flat_tokens import write_flat_tokens

TASKS = ("copy", "reverse", "sort", "shift")
SEPARATOR = 1  # token 0 is the begin-of-document input the model sees; never a target here
FIRST_TASK = 2
FIRST_SYMBOL = FIRST_TASK + len(TASKS)


def make_document(rng: np.random.Generator, alphabet: int, min_len: int, max_len: int) -> np.ndarray:
    task = int(rng.integers(len(TASKS)))
    n = int(rng.integers(min_len, max_len + 1))
    symbols = rng.integers(0, alphabet, size=n)
    answer = {
        "copy": symbols,
        "reverse": symbols[::-1],
        "sort": np.sort(symbols),
        "shift": (symbols + 1) % alphabet,
    }[TASKS[task]]
    return np.concatenate([[FIRST_TASK + task], FIRST_SYMBOL + symbols, [SEPARATOR],
                           FIRST_SYMBOL + answer]).astype(np.uint32)


def make_split(seed: int, num_tokens: int, alphabet: int, min_len: int, max_len: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < num_tokens:
        docs.append(make_document(rng, alphabet, min_len, max_len))
        total += len(docs[-1])
    return docs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="path of the flat-tokens zarr to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-tokens", type=int, default=4_000_000)
    parser.add_argument("--validation-tokens", type=int, default=200_000)
    parser.add_argument("--alphabet", type=int, default=64, help="number of distinct symbols")
    parser.add_argument("--min-len", type=int, default=4, help="shortest string of a task")
    parser.add_argument("--max-len", type=int, default=24, help="longest string of a task")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    args = parser.parse_args(argv)
    if not (0 < args.min_len <= args.max_len) or args.alphabet < 2:
        parser.error("need 0 < --min-len <= --max-len and --alphabet >= 2")
    splits = {
        "train": make_split(args.seed * 2, args.train_tokens, args.alphabet, args.min_len, args.max_len),
        "validation": make_split(args.seed * 2 + 1, args.validation_tokens, args.alphabet, args.min_len, args.max_len),
    }
    attrs = {"tokenizer": {"kind": "synthetic", "tasks": list(TASKS), "alphabet": args.alphabet, "seed": args.seed}}
    write_flat_tokens(args.output, splits, attrs, overwrite=args.overwrite)
    print(f"wrote {args.output}: {sum(map(len, splits['train']))} train tokens, "
          f"{sum(map(len, splits['validation']))} validation tokens")


if __name__ == "__main__":
    main()
