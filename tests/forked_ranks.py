"""Run N ranks of a test worker script from one import: ``python tests/forked_ranks.py N
SCRIPT ARGS...`` imports SCRIPT as a module (torch, the project, the worker's own code),
then forks N children, each with the variables a launcher gives a rank (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT: ``init_process_group``'s env:// rendezvous, rank 0
hosting the store), and calls the module's ``main()`` in each with ``sys.argv`` =
[SCRIPT, ARGS...].

Why: under torchrun every rank imports torch and the project again (about 3.5 s of CPU
each, plus torchrun's own 2 s), so a 2-rank test run paid 9 s of start-up and the 8-rank
layout group 30 s; here they pay one import (issue 69: the suite's CPU). The workers test
layouts, not the launcher: tools/run_local.py -> torchrun -> train.py is
tests/test_parallel_launch.py's, and tests/test_relayout.py's first run goes through it.

Fork is safe here because nothing has started a thread yet: importing torch and the
project starts none (with one OpenMP thread, as helpers.run_script sets; a team would be
made on first use, in each child). Each child dies with this process (PR_SET_PDEATHSIG);
when one fails, the others are killed, as torchrun does, and this process exits with the
first failure's status (a child's exception: 1, with its traceback on stderr).
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

from pretrain.launch.lifeline import die_with_parent


def free_port() -> int:
    """A port nothing listens on now, for rank 0's store (as torch's own tests pick one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(main, rank: int, argv: list[str]) -> int:
    """In a forked child: this rank's variables, then the worker's ``main()``; its status."""
    die_with_parent()
    faulthandler.enable()  # a rank that dies of a signal (SIGSEGV) prints where, on stderr
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    sys.argv = argv
    try:
        main()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - any failure is this rank's status, printed
        traceback.print_exc()
        return 1


def launch(nproc: int, script: Path, args: list[str]) -> int:
    sys.path.insert(0, str(script.parent))  # the worker imports its neighbours (helpers)
    main = importlib.import_module(script.stem).main
    gc.freeze()  # the imports, out of the ranks' collections and this launcher's exit
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = run_rank(main, rank, [str(script), *args])
            sys.stdout.flush()
            sys.stderr.flush()
            # no interpreter shutdown: a rank's gloo threads and the parent's atexit
            # handlers are not this child's to run (main() has left its process group)
            os._exit(code)
        children[pid] = rank
    status = 0
    while children:
        pid, wait_status = os.wait()
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            for other in children:  # the others would wait in a collective for it
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    sys.exit(launch(int(sys.argv[1]), Path(sys.argv[2]).resolve(), sys.argv[3:]))
