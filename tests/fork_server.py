"""A command-line tool's ``main(argv)`` run many times, each in a fresh fork of one process
that imported it once: ``ForkServer("pretrain.tools.plan").run(argv)`` gives what
``python tools/plan.py ARGV`` gives (exit status, stdout, stderr), without paying the
import of torch and the project again (about 3.5 s of CPU a call, issue 69).

Each call runs in a child forked from the server, so it starts from the state a fresh
process has after the imports (its own process group, fake modes, memory peaks), and
nothing it does reaches the next call. The server is ``python tests/fork_server.py
MODULE``: it reads one JSON request a line on stdin ({"argv", "out", "err"}: the files
the child's stdout and stderr go to; "cwd" and "env": the child's, when given) and answers
{"code"} a line on stdout; it stops when its stdin closes (the test process that started
it exited, however it ended). Fork is safe there: importing torch and the project starts
no thread (one OpenMP thread, as set below).

A script instead of a module: ``ForkServer("train.py", preload=(...))`` imports the
``preload`` modules once (what the script imports at its top and on its way to its
work: torch, Hydra, the trainer) and runs the script itself as ``__main__`` in each child,
its argv ``sys.argv[1:]``: the same code ``python train.py ARGV`` runs, top-level checks,
Hydra and exit status included, without the 3 s of imports a call.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
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

    def __init__(self, module: str, preload: tuple[str, ...] = ()):
        self.module = module
        self.preload = preload
        self.proc: subprocess.Popen | None = None

    def run(self, argv: list[str], timeout: float = 300, cwd: Path | str | None = None,
            env: dict[str, str] | None = None) -> tuple[int, str, str]:
        """``argv``'s (status, stdout, stderr); ``cwd`` and ``env`` (the whole environment)
        for this call, else the server's."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, self.module, *self.preload], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = {"argv": argv, "out": str(out), "err": str(err),
                       "cwd": None if cwd is None else str(cwd), "env": env}
            self.proc.stdin.write(json.dumps(request) + "\n")
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


def call(main, argv: list[str], out: str, err: str, cwd: str | None = None,
         env: dict[str, str] | None = None) -> int:
    """In the forked child: stdout and stderr to the files (stdin empty), ``cwd`` and
    ``env`` when given, ``main(argv)``, its status."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
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


def script_main(script: str):
    """A script's ``main(argv)``: the file run as ``__main__`` with ``sys.argv`` set."""
    def main(argv: list[str]) -> int:
        sys.argv = [script, *argv]
        runpy.run_path(script, run_name="__main__")
        return 0
    return main


def serve(module: str, preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    main = script_main(module) if module.endswith(".py") else importlib.import_module(
        module).main
    gc.freeze()  # the imports, out of every call's collections (train.py does the same)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            die_with_parent()
            os._exit(call(main, request["argv"], request["out"], request["err"],
                          request.get("cwd"), request.get("env")))
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
