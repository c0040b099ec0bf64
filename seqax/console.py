"""How seqax speaks on the console: each line signed `seqax` (a single process, or process 0 of
several) or `seqax[process i]`; warnings on stderr. Standard library only: train.py installs its
first signal handler with it before jax is imported."""

import sys


def signature(process_index: int = 0) -> str:
    return "seqax" if process_index == 0 else f"seqax[process {process_index}]"


def warn(message: str):
    print(f"seqax: warning: {message}", file=sys.stderr, flush=True)


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its class's name when it has none: how a one-line
    message quotes a library's error (the rest is usually a traceback or a long payload)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
