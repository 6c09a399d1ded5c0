"""tests/slurm_cluster.py's holder under ``pytest -n auto``: two processes that want the
local cluster at once (two xdist workers, or two checkouts) take turns, and neither stops a
cluster the other is using. Issue 62: a worker's module fixture stopped, at its end, the
cluster another worker had found running and was using; that worker's job never started.

The cluster here is a stand-in for slurm/local_cluster.sh with the same commands (start,
status, env, stop) on a state directory, so the test needs no Slurm and runs everywhere;
what it checks is the holders' protocol, which is the part that broke."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO

FAKE_CLUSTER = """#!/usr/bin/env bash
set -eu
state=$SLURM_LOCAL_DIR
case $1 in
  start) mkdir -p "$state"; echo start >> "$LOG"; nproc > "$state.cpus" ;;
  status) test -d "$state" ;;
  env) echo "export SLURM_CONF=$state/slurm.conf" ;;
  stop) rm -rf "$state"; echo stop >> "$LOG" ;;
esac
"""

# One holder: says it is waiting, holds the cluster, and inside waits for the file named
# by its first argument before it looks at the cluster again and leaves.
HOLDER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from slurm_cluster import held_cluster
name, wait_for, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
env = dict(os.environ)
(work / f"{{name}}.waiting").touch()
with held_cluster(Path({script!r}), env, lock=work / "lock") as conf:
    (work / f"{{name}}.inside").touch()
    while not wait_for.exists():
        time.sleep(0.05)
    up = Path(conf).parent.is_dir()
    (work / f"{{name}}.saw").write_text("up" if up else "down")
(work / f"{{name}}.left").touch()
"""


def holder(tmp_path: Path, name: str, wait_for: Path, env: dict) -> subprocess.Popen:
    script = tmp_path / "fake_cluster.sh"
    code = HOLDER.format(tests=str(REPO / "tests"), script=str(script))
    return subprocess.Popen([sys.executable, "-c", code, name, str(wait_for), str(tmp_path)],
                            env=env)


def test_two_holders_take_turns_and_neither_stops_the_others_cluster(tmp_path):
    (tmp_path / "fake_cluster.sh").write_text(FAKE_CLUSTER)
    env = {"PATH": "/usr/bin:/bin", "SLURM_LOCAL_DIR": str(tmp_path / "state"),
           "LOG": str(tmp_path / "cluster.log")}
    # a starts the cluster and stays until b is waiting for it; b, started once a is
    # inside, looks at the cluster only after a has left (at once, if it had to wait for a)
    a = holder(tmp_path, "a", tmp_path / "b.waiting", env)
    while not (tmp_path / "a.inside").exists():
        assert a.poll() is None, "a ended before it held the cluster"
        time.sleep(0.05)
    b = holder(tmp_path, "b", tmp_path / "a.left", env)
    assert a.wait(timeout=60) == 0 and b.wait(timeout=60) == 0
    assert (tmp_path / "a.saw").read_text() == "up"
    assert (tmp_path / "b.saw").read_text() == "up"  # a's stop did not pull it from under b
    # each started the cluster it found down and stopped it: in turn, never overlapping
    assert (tmp_path / "cluster.log").read_text().split() == ["start", "stop", "start", "stop"]
    assert not (tmp_path / "state").exists()


def test_a_running_cluster_is_used_and_left_running(tmp_path):
    """CI starts the cluster before pytest: the holders use it and never stop it."""
    (tmp_path / "fake_cluster.sh").write_text(FAKE_CLUSTER)
    (tmp_path / "state").mkdir()
    env = {"PATH": "/usr/bin:/bin", "SLURM_LOCAL_DIR": str(tmp_path / "state"),
           "LOG": str(tmp_path / "cluster.log")}
    (tmp_path / "go").touch()
    for name in ("a", "b"):
        assert holder(tmp_path, name, tmp_path / "go", env).wait(timeout=60) == 0
        assert (tmp_path / f"{name}.saw").read_text() == "up"
    assert not (tmp_path / "cluster.log").exists() and (tmp_path / "state").is_dir()


def test_a_cluster_a_worker_starts_gets_every_cpu(tmp_path):
    """An xdist worker runs with OMP_NUM_THREADS=1 (conftest.py), which nproc counts: the
    cluster it starts must still get the machine's CPUs, or a job asking for them waits
    forever (issue 62's Slurm failure)."""
    (tmp_path / "fake_cluster.sh").write_text(FAKE_CLUSTER)
    (tmp_path / "go").touch()
    env = {"PATH": "/usr/bin:/bin", "SLURM_LOCAL_DIR": str(tmp_path / "state"),
           "LOG": str(tmp_path / "cluster.log"), "OMP_NUM_THREADS": "1"}
    assert holder(tmp_path, "a", tmp_path / "go", env).wait(timeout=60) == 0
    assert int((tmp_path / "state.cpus").read_text()) == len(os.sched_getaffinity(0))
