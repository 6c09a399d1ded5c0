"""A command-line tool's ``main(argv)`` run many times, each in a fresh fork of one process
that imported it once: ``ForkServer("pretrain.tools.plan").run(argv)`` gives what
``python tools/plan.py ARGV`` gives (exit status, stdout, stderr), without paying the
import of torch and the project again (about 3.5 s of CPU a call, issue 69).

Each call runs in a child forked from the server, so it starts from the state a fresh
process has after the imports (its own process group, fake modes, memory peaks), and
nothing it does reaches the next call. The server is ``python tests/fork_server.py
MODULE``: it reads one JSON request a line on stdin ({"argv", "out", "err"}: the files
the child's stdout and stderr go to) and answers {"code"} a line on stdout; it stops when
its stdin closes (the test process that started it exited, however it ended). Fork is
safe there: importing torch and the project starts no thread (one OpenMP thread, as set
below).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from pretrain.launch.lifeline import die_with_parent


class ForkServer:
    """The client: starts the server on the first call, in this environment with one
    OpenMP thread (as each tool run here had)."""

    def __init__(self, module: str):
        self.module = module
        self.proc: subprocess.Popen | None = None

    def run(self, argv: list[str], timeout: float = 300) -> tuple[int, str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, self.module], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            self.proc.stdin.write(json.dumps({"argv": argv, "out": str(out),
                                              "err": str(err)}) + "\n")
            self.proc.stdin.flush()
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                self.proc.kill()  # the call's child dies with it (PR_SET_PDEATHSIG)
                raise TimeoutError(f"{self.module} {argv} ran over {timeout} s")
            line = self.proc.stdout.readline()  # the server's answer, when the call ends
            assert line, f"the fork server of {self.module} died"
            return json.loads(line)["code"], out.read_text(), err.read_text()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()  # the server's loop ends
            self.proc.wait(timeout=60)
            self.proc = None


def call(main, argv: list[str], out: str, err: str) -> int:
    """In the forked child: stdout and stderr to the files, ``main(argv)``, its status."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    try:
        code = main(argv)
        return code if isinstance(code, int) else 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a process: 1
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve(module: str) -> None:
    main = importlib.import_module(module).main
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            die_with_parent()
            os._exit(call(main, request["argv"], request["out"], request["err"]))
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
