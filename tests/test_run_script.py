"""tests/helpers.run_script on a timeout kills the launcher and every process under it:
torchrun's agent starts each rank in a session of its own, so a rank of a hung run once
outlived its test for 45 minutes (issue 56)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from helpers import run_script

# a launcher standing in for torchrun: one child in a session of its own, then both wait
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_timed_out_launcher_takes_its_ranks_with_it(tmp_path):
    script, pid_file = tmp_path / "launcher.py", tmp_path / "child.pid"
    script.write_text(LAUNCHER)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(script, str(pid_file), cwd=tmp_path, timeout=3)
    assert time.monotonic() - t0 < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
