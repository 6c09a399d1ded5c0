"""torchrun for ``tools/run_local.py``: torch's own launcher (``torch.distributed.run``'s
``parse_args`` and ``run``, its arguments unchanged), whose failure is reported as one line
per distinct rank error instead of the agent's traceback and failure table.

Each rank reports a project error (``pretrain.errors.UserError``) to the error file the
agent gives it (``TORCHELASTIC_ERROR_FILE``), and stays silent on stderr while
``AGENT_REPORTS`` is set (here): the agent stops the other ranks after the first failure,
possibly before they print, so the line is printed here, once, whatever rank failed first.
The status is the first failed rank's (2 for a project error), as accelerate does around the
same API. ``python -m pretrain.launch.torchrun`` takes torchrun's arguments.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from pretrain.errors import AGENT_REPORTS


def failure_lines(error: ChildFailedError) -> list[str]:
    """One line per distinct failure, the first failure's first: a rank's reported line(s)
    (``error: ...``), else its exit code or signal (a bug's traceback is on its stderr)."""
    first, _ = error.get_first_failure()
    lines: list[str] = []
    for rank, failure in sorted(error.failures.items(), key=lambda kv: kv[0] != first):
        message = failure.message
        text = message.get("message") if isinstance(message, dict) else None
        if isinstance(text, str) and text.startswith("error: "):
            new = text.splitlines()
        elif failure.exitcode < 0 and rank != first:
            continue  # stopped by the agent after the first failure
        else:
            how = (f"signal {failure.signal_name()}" if failure.exitcode < 0
                   else f"exit code {failure.exitcode}")
            new = [f"error: rank {rank} of {error.name} failed ({how}); its traceback is "
                   "above"]
        lines += [line for line in new if line not in lines]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ[AGENT_REPORTS] = "1"  # the ranks inherit it: their errors are printed here
    try:
        run(args)
    except ChildFailedError as e:
        print("\n".join(failure_lines(e)), file=sys.stderr, flush=True)
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
