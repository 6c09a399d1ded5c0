"""The GPU benchmarks (benchmarks/gpu/) stay runnable between GPU sessions: every shell
script parses, every Python file compiles, and the host-time split of a trainer step runs a
real (CPU) step and accounts for its time: each region inside the step, none counted twice."""

from __future__ import annotations

import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_every_gpu_script_parses(script):
    r = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("source", sorted(p.name for p in GPU.glob("*.py")))
def test_every_gpu_python_file_compiles(source, tmp_path):
    py_compile.compile(str(GPU / source), cfile=str(tmp_path / "c.pyc"), doraise=True)


def test_step_regions_splits_a_cpu_step_into_its_parts(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))
    sys.modules.pop("step_regions", None)
    import step_regions

    r = step_regions.measure(["+recipe=tiny", "train.device=cpu", "precision=fp32",
                              "model.n_layer=1", "train.noise_scale=false"], 2, 1, None)
    regions = r["regions_ms"]
    assert {"batch", "forward_backward", "clip", "optimizer", "zero_grad",
            "schedule"} <= set(regions)
    # the regions are disjoint parts of the step: together no more than the step's host time
    assert sum(regions.values()) <= r["host_ms"] * 1.001 + 0.01
    assert r["rest_ms"] >= -0.01
    ops = r["ops_per_step"]  # the matmuls run in forward/backward, the update in optimizer
    assert ops["forward_backward"] > 0 and ops["optimizer"] > 0 and ops["clip"] > 0
    assert r["device_ms"] is None  # no device timeline on a CPU
