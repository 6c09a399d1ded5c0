"""A torchft group coming back starts out of the live groups' way (docs/reliability.md#torchft):
slurm/ft_group.sbatch starts a requeued group under nice, and the group returns every thread
to its priority as it asks to join (``startup_priority_restored``); its CPU peak is the one
its first start measured (``PeakFlops(kept=...)``), not a timing of what nice leaves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from helpers import REPO

RESTORE = """
import os, threading
from pretrain.parallel.replica_groups import NICE_ENV, startup_priority_restored
base = os.getpriority(os.PRIO_PROCESS, 0)
os.nice(5)  # the start-up's priority, inherited by the threads started meanwhile
done = threading.Event()
worker = threading.Thread(target=done.wait)
worker.start()
os.environ[NICE_ENV] = str(base)
startup_priority_restored()
nices = {int(open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[16]) - base
         for t in os.listdir("/proc/self/task")}
done.set()
print(sorted(nices), NICE_ENV in os.environ)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="returning to a lower nice value needs root (or RLIMIT_NICE)")
def test_a_niced_start_up_returns_every_thread_to_its_priority():
    out = subprocess.run([sys.executable, "-c", RESTORE], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")}, check=True)
    assert out.stdout.split("\n")[0] == "[0] False", out.stdout + out.stderr


def test_a_torchft_groups_cpu_peak_is_measured_once_for_all_its_starts(tmp_path, monkeypatch):
    import pretrain.train.metrics as metrics

    timed = []
    monkeypatch.delenv(metrics.CPU_PEAKS_ENV, raising=False)  # conftest hands one down
    monkeypatch.setattr(metrics, "measure_matmul_flops",
                        lambda dtype, device: timed.append(dtype) or 5e10)
    policy = types.SimpleNamespace(compute_dtype=torch.float32, name="fp32")
    kept = tmp_path / "group1" / "cpu_peak.json"
    for _ in range(2):  # two starts: two processes, each with no peak of its own yet
        monkeypatch.setattr(metrics, "_CPU_PEAKS", {})
        peak = metrics.PeakFlops(torch.device("cpu"), policy, 1, measure=True, kept=kept)
        assert peak.value == 5e10
    assert timed == [torch.float32]
    # a peak the parent process hands down comes first (tests/conftest.py's, a launcher's)
    monkeypatch.setattr(metrics, "_CPU_PEAKS", {})
    monkeypatch.setenv(metrics.CPU_PEAKS_ENV, json.dumps(
        {metrics.peak_key(torch.float32, torch.get_num_threads()): 7e10}))
    peak = metrics.PeakFlops(torch.device("cpu"), policy, 1, measure=True, kept=kept)
    assert peak.value == 7e10 and timed == [torch.float32]
