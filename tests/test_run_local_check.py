"""tools/run_local.py checks the whole config, with the world size it will launch, before
any process starts: one short message, exit status 2, no torchrun."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO


def run_local(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "run_local.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def test_run_local_refuses_an_indivisible_batch_before_torchrun_starts():
    proc = run_local("+recipe=tiny", "parallel=zero3", "parallel.dp=2")
    assert proc.returncode == 2, proc.stderr
    assert "train.global_batch_size=8" in proc.stderr and "dp=2" in proc.stderr
    assert "torch.distributed.run" not in proc.stderr + proc.stdout
    assert "ChildFailedError" not in proc.stderr and len(proc.stderr.splitlines()) < 8
    # the fix the message names: a batch dp divides, and the launch command is made
    fixed = run_local("--print", "+recipe=tiny", "parallel=zero3", "parallel.dp=2",
                      "train.global_batch_size=16")
    assert fixed.returncode == 0 and "--nproc_per_node=2" in fixed.stdout, fixed.stderr
