"""The packages of the evaluation and plotting tools (requirements-tools.txt, installed by `make tools`), which a
run does not need: a tool that misses one stops with one line that says how to install it."""

import importlib
import importlib.util

from seqax.config import SeqaxError

INSTALL = "`make tools` installs it (requirements-tools.txt)"


class MissingPackage(SeqaxError):
    """An optional package that a tool needs is not installed."""


def require(module: str, needed_by: str):
    """`import module` for `needed_by` (the tool, as a user calls it), or MissingPackage naming `make tools`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:  # the package is there, but broken: its own error says more
            raise
        raise MissingPackage(f"{needed_by} needs the `{module}` package, which is not installed: {INSTALL}") from None


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
