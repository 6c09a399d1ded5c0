"""The fit policy's decisions are the runs', not the arithmetic's (issue 68): the same choice,
the same refusals and every figure within 0.05 percentage points under a relative jitter of
1e-9 on the inputs, twice the optimizer's starts, and other BLAS kernels (OpenBLAS reads
OPENBLAS_CORETYPE when it loads, so those run in their own processes). rw_original is the
ladder whose choice flipped with the kernels (a Chinchilla fit on two sizes, now refused as
undetermined); OLMo's is the closest choice of the four."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("scipy", reason="the analysis extra: pip install -e '.[analysis]'")

from pretrain.analysis.laws import Law  # noqa: E402
from pretrain.analysis.policy import degenerate  # noqa: E402
from pretrain.analysis.runs import RunPoint  # noqa: E402
from pretrain.tools.fit_stability import decisions, differences, jittered  # noqa: E402
from pretrain.tools.ladders_manifest import ladder_and_targets  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def base():
    return {name: decisions(*ladder_and_targets(name)) for name in ("rw_original", "olmo")}


@pytest.mark.parametrize("name", ["rw_original", "olmo"])
def test_jitter_and_twice_the_starts_change_no_decision(name, base):
    ladder, targets = ladder_and_targets(name)
    assert differences(base[name], decisions(jittered(ladder, 1e-9), targets)) == []
    assert differences(base[name], decisions(ladder, targets, keep=8)) == []


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="OPENBLAS_CORETYPE names x86 kernels")
@pytest.mark.parametrize("coretype", ["Haswell", "Sandybridge"])
def test_other_blas_kernels_change_no_decision(coretype, base):
    env = {**os.environ, "OPENBLAS_CORETYPE": coretype,
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pretrain.tools.fit_stability", "rw_original",
                          "--json"],
                         env=env, capture_output=True, text=True, check=True, timeout=300)
    other = json.loads(out.stdout)["rw_original"]
    assert differences(base["rw_original"], other) == []


def test_a_chinchilla_fit_on_two_sizes_is_undetermined():
    """Two sizes give E + A/N^alpha two values for three unknowns: a valley of exact fits."""
    runs = [RunPoint(f"r{i}", n, d, 6 * n * d, 3.0 + 100 / n**0.3 + 100 / d**0.3)
            for i, (n, d) in enumerate((n, 20 * n * k) for n in (1e6, 1e7)
                                       for k in (0.5, 1, 2, 4))]
    law = Law("chinchilla", {"E": 3.0, "A": 100, "B": 100, "alpha": 0.3, "beta": 0.3})
    assert "2 sizes for a form that needs 3" in degenerate(law, runs)
    shared = Law("shared", {"E": 3.0, "A": 100, "B": 100, "alpha": 0.3})
    assert degenerate(shared, runs) is None
