"""Where a command writes never overlaps what it reads. A tool that replaces its output (export_hf and
prepare_dataset with --overwrite) deletes what was there, and one that writes into an input changes what
it reads: an output that is, holds or lies inside one of its inputs is refused before anything is
written (docs/reliability.md)."""

import os

from seqax.config import ConfigError


def check_output_apart(output: str, inputs: list[tuple[str, str]], flag: str = "--output", error=ConfigError):
    """Raises `error` (one line) when `output` is, contains or lies inside one of `inputs`: (what the
    user calls it, e.g. "the run directory 'runs/a' (--run-dir)", its path). Links are followed, so
    another name for an input is the input."""
    out = os.path.realpath(output)
    where = [(name, os.path.realpath(path)) for name, path in inputs]
    for name, path in where:
        if out == path or path.startswith(out + os.sep):
            raise error(f"{flag} {output!r} is or contains {name}, which writing it would delete; "
                        f"choose another {flag}")
    for name, path in where:
        if out.startswith(path + os.sep):
            raise error(f"{flag} {output!r} lies inside {name}, which this command reads; "
                        f"choose a {flag} outside it")
