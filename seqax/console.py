"""How seqax speaks on the console: each line signed `seqax` (a single process, or process 0 of
several) or `seqax[process i]`; warnings on stderr. Standard library only: train.py installs its
first signal handler with it before jax is imported."""

import sys


def signature(process_index: int = 0) -> str:
    return "seqax" if process_index == 0 else f"seqax[process {process_index}]"


def warn(message: str):
    print(f"seqax: warning: {message}", file=sys.stderr, flush=True)
