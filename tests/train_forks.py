"""``python train.py ARGS`` for tests whose subject is what train.py does with its arguments
(the error it prints, its exit status, the run directory it writes, the run it trains),
each call in a fresh fork of one process per pytest worker that imported torch, Hydra and
the trainer once (tests/fork_server.py): a train.py start imports them again, about 3 s
of CPU a call (issue 69). The child runs train.py itself as ``__main__`` (its top-level
checks, Hydra, the trainer, ``sys.exit``), in the test's folder and environment, with its
own stdout, stderr and exit status. A real interpreter start of train.py is kept where the
process is the subject: tests/test_mixture.py's killed run, tests/test_reliability.py's
recipe path refused before Hydra, tests/test_cli_errors.py's runs_dir refused by the
Hydra callback, and the torchrun launches of tests/test_parallel_launch.py.

A tool that starts train.py itself (tools/ladder.py's streams) is given ``forked_processes()``
as its ``subprocess`` module: the same commands, run at once as the tool starts them, each
in a fork of a server of its own."""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from fork_server import ForkServer
from helpers import REPO, launch_env

TRAIN = str(REPO / "train.py")
# what train.py imports at its top and on its way to a run or a dry run
PRELOAD = ("hydra", "omegaconf", "hydra.core.hydra_config", "pretrain.launch.lifeline",
           "pretrain.config.naming", "pretrain.config.structured", "pretrain.errors",
           "pretrain.train.fault_tolerant", "pretrain.decision.resolve")
SERVER = ForkServer(TRAIN, preload=PRELOAD)
atexit.register(SERVER.close)  # waited for: its CPU counts in the pytest run's own


def train_py(*args: str, cwd: Path | str, timeout: float = 300,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """As ``subprocess.run([python, train.py, *args], cwd=cwd, capture_output=True,
    text=True, env=launch_env(**env))`` gives it."""
    code, out, err = SERVER.run(list(args), timeout=timeout, cwd=cwd,
                                env=launch_env(**(env or {})))
    return subprocess.CompletedProcess([TRAIN, *args], code, out, err)


class Servers:
    """SERVER, and more servers of train.py for the runs started while it is busy."""

    def __init__(self):
        self.all, self.busy, self.lock = [SERVER], set(), threading.Lock()

    def take(self) -> ForkServer:
        with self.lock:
            free = [s for s in self.all if s not in self.busy]
            server = free[0] if free else ForkServer(TRAIN, preload=PRELOAD)
            if not free:
                self.all.append(server)
            self.busy.add(server)
            return server

    def give(self, server: ForkServer) -> None:
        with self.lock:
            self.busy.discard(server)

    def close(self) -> None:
        for server in self.all[1:]:
            server.close()


class Forked:
    """``subprocess.Popen([python, train.py, *args], env=env, cwd=cwd)`` as a fork of a free
    server: runs started side by side run side by side, each printing its output when it
    ends."""

    def __init__(self, cmd: list[str], servers: Servers, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None):
        assert cmd[:2] == [sys.executable, TRAIN], f"not a train.py command: {cmd}"
        self.args, self.returncode, self.servers = cmd, None, servers
        self.thread = threading.Thread(target=self._run, args=(cmd[2:], env, cwd))
        self.thread.start()

    def _run(self, args: list[str], env: dict[str, str] | None, cwd) -> None:
        code, server = 1, self.servers.take()
        try:
            code, out, err = server.run(args, cwd=cwd, env=env)
            sys.stdout.write(out)
            sys.stderr.write(err)
        except BaseException:  # noqa: BLE001 - the run failed: its status says so
            traceback.print_exc()
        finally:
            self.servers.give(server)
            self.returncode = code

    def wait(self) -> int:
        self.thread.join()
        return self.returncode


@contextlib.contextmanager
def forked_processes() -> Iterator[SimpleNamespace]:
    """A stand-in for the ``subprocess`` module of a tool whose ``Popen`` and ``run`` start
    train.py commands (``[sys.executable, TRAIN, ...]``): each one a fork of SERVER or, while
    that one is busy, of another server started for it; those are closed on leaving."""
    servers = Servers()

    def popen(cmd, env=None, cwd=None) -> Forked:
        return Forked(cmd, servers, env=env, cwd=cwd)

    def run(cmd, env=None, cwd=None) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, popen(cmd, env=env, cwd=cwd).wait())

    try:
        yield SimpleNamespace(Popen=popen, run=run)
    finally:
        servers.close()
