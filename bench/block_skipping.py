"""How much attention work skipping key blocks by document saves, per device's rows or per row.

    .venv/bin/python -m bench.block_skipping [--dataset synthetic_dataset.zarr] [--length 2048]
        [--block 256] [--rows-per-device 1 2 4 8 16] [--batches 8]

attention.ring_attention visits, for each query block, the key blocks from the one holding the
earliest document start among its queries up to the diagonal, taking that earliest start over
all the rows a device holds (one loop for all of them). Skipping per row would let each row stop
at its own document's start. This counts the block pairs each rule computes on packed rows of a
dataset, as the loader makes them (rows of --length, shuffled), and prints them against causal
attention without any skipping: the share of attention's block-pair work that each rule does.
Pairs are counted per row (a pair computed for R rows at once counts R times), so the ratios are
of matmul work; what per-row skipping would save in time on top is at most the difference.
"""

import argparse

import numpy as np

from seqax.data.data_loader import RowOrder, RowSource
from seqax.data.flat_tokens import open_flat_tokens


def first_key_blocks(doc_start: np.ndarray, block: int) -> np.ndarray:
    """[rows, N]: the block holding the start of the document of each query block's first query."""
    return doc_start[:, ::block] // block


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="synthetic_dataset.zarr")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--rows-per-device", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batches", type=int, default=8, help="batches of the largest rows-per-device to count over")
    args = parser.parse_args(argv)
    if args.length % args.block:
        parser.error(f"--block {args.block} must divide --length {args.length}")
    source = RowSource(open_flat_tokens(args.dataset), "train", args.length, packed=True)
    order = RowOrder(source.rows, 1, 64, 1, 0)  # shuffled rows, as the loader's seed 0 gives them
    rows = args.batches * max(args.rows_per_device)
    encoded = np.concatenate([source.read_block(int(row), 1)[0] for row in order.rows_of(np.arange(rows))])
    starts = (encoded & 1) == 1
    # Where each token's document starts (train.document_positions: a row that begins inside a
    # document counts it from the row's start, having no earlier keys).
    doc_start = np.maximum.accumulate(np.where(starts, np.arange(args.length), 0), axis=1)
    n = args.length // args.block
    diagonal = np.arange(n)
    first = first_key_blocks(doc_start, args.block)  # [rows, N]
    print(f"{args.dataset}: {rows} rows of {args.length}, blocks of {args.block} ({n} a row), "
          f"{starts.sum() / rows:.1f} document starts a row; block pairs as a share of causal attention's")
    print(f"{'rows per device':>15} {'per device (now)':>17} {'per row':>8} {'per row / now':>14}")
    for r in args.rows_per_device:
        groups = first[: rows // r * r].reshape(-1, r, n)
        per_device = int(np.sum(r * (diagonal + 1 - groups.min(axis=1))))
        per_row = int(np.sum(diagonal + 1 - groups))
        total = groups.shape[0] * r * int(np.sum(diagonal + 1))
        print(f"{r:>15} {per_device / total:>16.1%} {per_row / total:>8.1%} {per_row / per_device:>14.2f}")


if __name__ == "__main__":
    main()
