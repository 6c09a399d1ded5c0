"""One line per mistake, exit 2: how every entry point reports the project's own errors.

A ``pretrain.errors.UserError`` (``ConfigError``, ``DataError``, ``AttentionBackendError``,
...) is printed as ``error: <message>`` on stderr, one line per problem, and the process
exits 2, once; its traceback only with ``HYDRA_FULL_ERROR=1``, the switch Hydra itself reads
for its own errors. Any other exception is a bug and keeps its traceback.

Used three ways, one mechanism:

- ``@cli`` on a tool's ``main() -> int``: returns 2 after printing;
- ``with exit_on_user_error():`` in train.py's ``@hydra.main`` task function: raises
  ``SystemExit(2)``, which Hydra's job runner lets through (it catches ``Exception`` to print
  a traceback, and ``SystemExit`` is not one), as train.py's requeue exit 75 does;
- ``report(e)`` where a tool catches one itself.

Under torchrun every rank fails the same way on the same config, so only rank 0 prints;
each rank writes its line to the error file torchrun's agent names
(``TORCHELASTIC_ERROR_FILE``, the format of ``torch.distributed.elastic``'s ``@record``), so
the agent's failure summary shows the line of a rank that failed alone.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from pretrain.errors import EXIT_USAGE, UserError

__all__ = ["EXIT_USAGE", "UserError", "cli", "exit_on_user_error", "full_traceback", "report"]

F = TypeVar("F", bound=Callable[..., int])


def full_traceback() -> bool:
    """``HYDRA_FULL_ERROR=1``: let the error through with its whole traceback."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _record_for_torchrun(lines: list[str]) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "\n".join(lines)
    entry = {"message": text, "extraInfo": {"py_callstack": text,
                                             "timestamp": str(int(time.time()))}}
    try:
        with open(path, "w") as f:
            json.dump({"message": entry}, f)
    except OSError:
        pass  # the line on stderr (rank 0) is the report; the file is a courtesy


def report(error: UserError | str) -> int:
    """Print ``error: <line>`` for each mistake on stderr (rank 0 of a multi-process run)
    and return the exit status, 2."""
    lines = error.lines() if isinstance(error, UserError) else [" ".join(str(error).split())]
    lines = [f"error: {line}" for line in lines]
    _record_for_torchrun(lines)
    if _rank() == 0 or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        print("\n".join(lines), file=sys.stderr, flush=True)
    return EXIT_USAGE


def cli(main: F) -> F:
    """Decorate a tool's ``main() -> int``: a UserError becomes its line(s) and status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if full_traceback():
                raise
            return report(e)

    return wrapper  # type: ignore[return-value]


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Inside it, a UserError prints its line(s) and exits 2 (``SystemExit``)."""
    try:
        yield
    except UserError as e:
        if full_traceback():
            raise
        raise SystemExit(report(e)) from None
