"""A multiple-choice task from a flat-tokens dataset's validation documents: which line comes next?

    .venv/bin/python -m tools.make_choice_task --dataset text_dataset.zarr --output text_choices.jsonl \\
        [--examples 100] [--choices 4] [--context-chars 160] [--seed 0]

Each example (one JSONL line, the format evaluation.py and lm-evaluation-harness read) takes a
line of a validation document as the true answer: the context is the whole lines before it, up to
--context-chars characters, ending with the line break; the other choices are lines of other
validation documents of similar length, drawn with --seed. The label is the true line's place
among the shuffled choices. With `make train-text`, the run scores it at every evaluation
(`evaluation.tasks`): a model that learned the language picks the true line more often than
1 / --choices.
"""

import argparse
import json
import random
import sys

from seqax.config import SeqaxError
from seqax.data.flat_tokens import open_flat_tokens
from seqax.data.tokenizer import dataset_tokenizer
from seqax.outputs import check_output_apart


def validation_documents(path: str) -> list[str]:
    """The text of every validation document of the dataset at `path`."""
    dataset, tokenizer = open_flat_tokens(path), dataset_tokenizer(path)
    split = dataset.splits["validation"]
    starts = split.read("seq_starts", 0, split.seq_starts.shape[0])
    tokens = split.read("encoded_tokens", 0, split.num_tokens) >> 1  # token id * 2 + is_start
    return [tokenizer.decode(tokens[int(a) : int(b)]) for a, b in zip(starts[:-1], starts[1:])]


def candidate_lines(text: str, low: int, high: int) -> list[int]:
    """Indices of the lines worth asking about: low..high characters, not blank."""
    return [i for i, line in enumerate(text.split("\n")) if low <= len(line) <= high and line.strip()]


def examples(documents: list[str], count: int, choices: int, context_chars: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    lines = [d.split("\n") for d in documents]
    places = [(d, i) for d, text in enumerate(documents) for i in candidate_lines(text, 12, 80) if i > 0]
    if len({d for d, _ in places}) < 2:
        raise SystemExit("make_choice_task: the validation split needs lines of 12-80 characters in two or more "
                         "documents (distractors come from other documents)")
    out = []
    for d, i in rng.sample(places, min(count, len(places))):
        context, j = "", i
        while j > 0 and len(lines[d][j - 1]) + 1 + len(context) <= context_chars:
            context, j = lines[d][j - 1] + "\n" + context, j - 1
        if not context:
            continue
        true = lines[d][i]
        others = [lines[e][k] for e, k in places if e != d and abs(len(lines[e][k]) - len(true)) <= len(true) // 2
                  and lines[e][k] != true]
        if len(set(others)) < choices - 1:
            continue
        options = rng.sample(sorted(set(others)), choices - 1) + [true]
        rng.shuffle(options)
        out.append({"context": context, "choices": options, "label": options.index(true)})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="a flat-tokens dataset with a text tokenizer")
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context-chars", type=int, default=160, help="at most this many characters of context")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        check_output_apart(args.output, [(f"the dataset {args.dataset!r} (--dataset)", args.dataset)])
        written = examples(validation_documents(args.dataset), args.examples, args.choices, args.context_chars,
                           args.seed)
    except SeqaxError as e:
        print(f"seqax: error: {e}", file=sys.stderr)
        sys.exit(2)
    with open(args.output, "w", encoding="utf-8") as f:
        for example in written:
            f.write(json.dumps(example) + "\n")
    longest = max(len(e["context"]) + max(map(len, e["choices"])) for e in written)
    print(f"wrote {args.output}: {len(written)} examples of {args.choices} choices (chance {1 / args.choices:.2f}), "
          f"contexts and choices of at most {longest} characters")


if __name__ == "__main__":
    main()
