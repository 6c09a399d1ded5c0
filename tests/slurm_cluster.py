"""The local Slurm of slurm/local_cluster.sh, held by one test process at a time.

Under README's ``pytest -q -n auto`` the tests marked ``slurm`` land on several workers
(``--dist worksteal`` moves them between workers), and another pytest run on this machine
(another checkout) may want the cluster too: its ports (6817-6819, 3306) are the machine's,
so there is one cluster a machine whatever its state directory. A holder therefore takes an
exclusive lock on one file per machine (``fcntl.flock``: the kernel releases it if the
holder dies), uses the cluster if it is running or starts it, and at the end stops it only
if it started it. So no process stops a cluster while another uses it, and one holder's
jobs (each asks for the node's CPUs) never queue behind another's: the others wait for
the lock, not for a job. (Issue 62: two workers shared a cluster that one of them stopped,
and a job waited for CPUs another worker's job held.)
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# One lock a machine: the cluster's ports are the machine's, whatever SLURM_LOCAL_DIR says.
LOCK = Path(tempfile.gettempdir()) / "pretrain-slurm.lock"


# The states a job ends in (squeue/scontrol's JobState).
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


def job_info(job: int | str, env: dict[str, str]) -> dict[str, str]:
    """``scontrol show job``'s fields (empty once the controller has forgotten the job)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], env=env,
                         capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_job(job: int, env: dict[str, str], timeout: float = 300,
             describe: Callable[[int, dict[str, str]], object] = job_info) -> dict[str, str]:
    """Poll until the job reaches a final state (a requeued job passes through PENDING);
    past ``timeout`` cancel it and fail the test with ``describe``'s account of it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job, env)
        if info.get("JobState") in TERMINAL:
            return info
        time.sleep(0.2)
    why = describe(job, env)
    subprocess.run(["scancel", str(job)], env=env)
    pytest.fail(f"job {job} did not finish in {timeout} s: {why}")


_LAUNCHING = threading.Lock()


def launch(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    """``tools/launch.py ARGS`` in ``cwd`` with ``env`` for its environment (sbatch hands it to
    the job), run as its ``main`` in this process: its stdout; a non-zero exit fails the test.
    A new interpreter imported torch again for each submission, about 3 s of CPU beside the
    jobs it had just started (tests/test_launch.py runs the command line itself). One call at
    a time: the environment, the working directory and Hydra's state are the process's, and
    tests/test_slurm_nodes.py submits from two threads at once."""
    from hydra.core.hydra_config import HydraConfig

    from pretrain.tools import launch as tool

    out, err = io.StringIO(), io.StringIO()
    with _LAUNCHING:
        saved = dict(os.environ)
        _set_environ(env)
        try:
            with contextlib.chdir(cwd), contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(err):
                rc = tool.main(args)
        finally:
            _set_environ(saved)
            HydraConfig.instance().cfg = None
    assert rc == 0, err.getvalue()[-3000:]
    return out.getvalue()


def _set_environ(env: dict[str, str]) -> None:
    """os.environ made ``env``, touching only the variables that differ."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})


def sbin_path() -> str:
    """PATH with the sbin folders Debian's Slurm daemons are installed in."""
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def unavailable(script: Path, daemons: tuple[str, ...]) -> str | None:
    """Why a local Slurm cannot run here, or None (installing it first with ``script``'s
    ``install`` when it is missing and this is root on Debian/Ubuntu)."""
    if all(shutil.which(d, path=sbin_path()) for d in daemons):
        return None
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it (Debian/Ubuntu)"
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it (apt-get) needs root"
    proc = subprocess.run(["bash", str(script), "install"], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode:
        return f"could not install Slurm with apt-get: {proc.stderr.strip()[-500:]}"
    return None


class ClusterStartError(RuntimeError):
    """``local_cluster.sh start`` failed; the message holds the end of its stderr."""


def _script(script: Path, command: str, env: dict[str, str], **kwargs):
    return subprocess.run(["bash", str(script), command], env=env, capture_output=True,
                          text=True, **kwargs)


def machine_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the OpenMP limits: local_cluster.sh gives its node ``nproc`` CPUs,
    and nproc counts OMP_NUM_THREADS, which conftest.py sets to 1 in every xdist worker: a
    cluster a worker started had a 1-CPU node, where a job asking for 2 never starts (issue
    62: "the job never started within the test's 120 s")."""
    return {k: v for k, v in env.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}


@contextmanager
def held_cluster(script: Path, env: dict[str, str], lock: Path = LOCK) -> Iterator[str]:
    """Hold the cluster that ``script`` (slurm/local_cluster.sh) runs: wait for the lock,
    start the cluster if it is down, yield its SLURM_CONF; stop it afterwards only if this
    holder started it."""
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        started = _script(script, "status", env).returncode != 0
        if started:
            proc = _script(script, "start", machine_env(env), timeout=300)
            if proc.returncode:
                _script(script, "stop", env, timeout=120)
                raise ClusterStartError(f"{script.name} start failed:\n{proc.stderr[-3000:]}")
        try:
            line = _script(script, "env", env, check=True).stdout
            yield line.strip().split("=", 1)[1]
        finally:
            if started:
                _script(script, "stop", env, timeout=120)

