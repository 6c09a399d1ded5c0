"""The project's own errors, and how every entry point reports them: one line per
mistake on stderr, exit 2, once.

``UserError`` is the base of every error that is a mistake in what was asked (a key, a
value, a path, a missing package) and whose message names the key and the fix. Each wing
keeps its own type (``ConfigError``, ``DataError``, ``AttentionBackendError``, ...) with this
class among its bases, so no entry point needs to know them all. Any other exception is a
bug and keeps its traceback.

An entry point reports one as ``error: <message>`` on stderr, one line per problem, and
exits 2 (as argparse does for a bad option); the traceback only with ``HYDRA_FULL_ERROR=1``,
the switch Hydra reads for its own errors. Three ways to use it, one mechanism:

- ``@cli`` on a tool's ``main() -> int``: returns 2 after printing;
- ``with exit_on_user_error():`` in train.py's ``@hydra.main`` task function (and a Hydra
  callback): raises ``SystemExit(2)``, which Hydra lets through (its ``run_and_report``
  catches ``Exception`` to print a traceback; ``SystemExit`` is not one), as train.py's
  requeue exit 75 does;
- ``report(e)`` where a tool catches an error itself.

Under torchrun every rank fails the same way on the same config, so only rank 0 prints;
each rank writes its line to the error file torchrun's agent names
(``TORCHELASTIC_ERROR_FILE``, the JSON that torch.distributed.elastic's ``@record`` writes),
so the agent's failure summary shows the line of a rank that failed alone. Under
``tools/run_local.py`` (pretrain.launch.torchrun) no rank prints: the launcher prints each
distinct line once, and exits with the first failed rank's status.

The bottom of the layer contract: it imports nothing from the package.
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

EXIT_USAGE = 2  # as argparse's and Hydra's own command-line mistakes
# Set by pretrain.launch.torchrun (tools/run_local.py's launcher), which prints the ranks'
# lines itself, once: a rank then only writes its torchrun error file.
AGENT_REPORTS = "PRETRAIN_AGENT_REPORTS"

F = TypeVar("F", bound=Callable[..., int])


class UserError(Exception):
    """A mistake the user fixes; its message says which key and how."""

    def lines(self) -> list[str]:
        """The message as lines, one per mistake (a subclass listing several problems
        overrides this); whitespace, newlines included, folds to single spaces."""
        return [" ".join(str(self).split())]


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
        pass  # the line on stderr (rank 0) is the report; the file is for torchrun's summary


def report(error: BaseException | str) -> int:
    """Print ``error: <line>`` for each mistake on stderr (rank 0 only under torchrun) and
    return the exit status, 2."""
    lines = error.lines() if isinstance(error, UserError) else [" ".join(str(error).split())]
    lines = [f"error: {line}" for line in lines]
    _record_for_torchrun(lines)
    under_agent = bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))
    if not under_agent or (_rank() == 0 and not os.environ.get(AGENT_REPORTS)):
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
