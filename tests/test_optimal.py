"""The compute-optimal loss (tools/scaling_law.py --predict-optimal, analysis/optimal.py,
optimal_choice.py): on an iso-FLOP grid drawn from a known Chinchilla law with noise, both
approaches recover the true optimum's loss, N and D at 16x the largest budget; the answer
does not move under a 1e-9 jitter of the inputs or another set of OpenBLAS kernels; a ladder
with no iso-FLOP structure and a degenerate L(N, D) is refused in one line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy", reason="the analysis extra: pip install -e '.[analysis]'")

from pretrain.analysis.isoflop_fit import budgets, parabola_minimum, usable  # noqa: E402
from pretrain.analysis.nnls import best_subset_fit, solve_small  # noqa: E402
from pretrain.analysis.optimal_choice import choose, fit_approach, predict_optimal  # noqa: E402
from pretrain.analysis.runs import RunPoint  # noqa: E402
from pretrain.analysis.scaling import CHINCHILLA  # noqa: E402
from pretrain.tools import scaling_law  # noqa: E402

BUDGETS = np.geomspace(1e17, 1e19, 6)
TARGET = 16 * BUDGETS[-1]


def isoflop_grid(noise: float = 0.002, seed: int = 0, jitter: float = 0.0) -> list[RunPoint]:
    """9 sizes from N_opt/4 to 4 N_opt at each budget, losses from Hoffmann et al.'s law
    times a lognormal noise; ``jitter``: a relative perturbation of every input."""
    rng = np.random.default_rng(seed)
    wobble = np.random.default_rng(seed + 1)
    points = []
    for c in BUDGETS:
        n_opt, _ = CHINCHILLA.optimal(c)
        for f in np.geomspace(0.25, 4, 9):
            n = float(n_opt * f)
            d = c / 6 / n
            loss = float(CHINCHILLA.predict(n, d)) * math.exp(rng.normal(0, noise))
            n, d, loss = (v * (1 + jitter * wobble.uniform(-1, 1)) for v in (n, d, loss))
            points.append(RunPoint(f"c{c:.3g}-n{n:.4g}", n, d, 6 * n * d, loss,
                                   fields={"budget": f"{c:.6g}"}))
    return points


def truth(c: float) -> tuple[float, float, float]:
    n, d = CHINCHILLA.optimal(c)
    return float(CHINCHILLA.predict(n, d)), float(n), float(d)


def test_the_small_solver_and_the_nonnegative_fit_are_exact_on_exact_data():
    m = np.array([[[4.0], [2.0]], [[2.0], [3.0]]])
    x = solve_small(m, np.array([[2.0], [1.0]]))
    assert np.allclose(x[:, 0], [0.5, 0.0])
    t = np.linspace(1, 4, 7)
    y = 2.0 + 3.0 * t ** -0.5
    coef, sse = best_subset_fit([np.ones((1, 7)), t[None, :] ** -0.5], y)
    assert np.allclose(coef[:, 0], [2.0, 3.0]) and sse[0] < 1e-20


def test_a_budgets_parabola_finds_its_valley_and_says_why_not():
    pts = isoflop_grid(noise=0.0)
    found = budgets(pts)
    assert len(found) == 6 and all(b.problem is None for b in found)
    for b in found:
        assert b.n_opt == pytest.approx(truth(b.flops)[1], rel=0.03)
        assert b.loss == pytest.approx(truth(b.flops)[0], rel=1e-3)
    edge = sorted(found[0].runs, key=lambda p: p.n_params)[:4]  # the valley beyond them
    assert "outside the sizes" in parabola_minimum(edge)


@pytest.mark.parametrize("which", ["2", "3"])
def test_both_approaches_recover_the_known_optimum_at_16x(which):
    model = fit_approach(which, isoflop_grid())
    loss, n, d = model.at(TARGET)
    true_loss, true_n, true_d = truth(TARGET)
    assert loss == pytest.approx(true_loss, rel=0.015)
    assert n == pytest.approx(true_n, rel=0.25)
    assert d == pytest.approx(true_d, rel=0.25)
    assert 6 * n * d == pytest.approx(TARGET, rel=1e-9)


def test_the_choice_is_backtested_and_its_interval_covers_the_truth():
    choice, (opt,) = predict_optimal(isoflop_grid(), [TARGET], resamples=20)
    assert not choice.refused and choice.cuts
    assert choice.chosen == min(choice.scores, key=choice.scores.get)
    assert opt.loss == pytest.approx(truth(TARGET)[0], rel=0.015)
    assert opt.interval[0] < opt.loss < opt.interval[1]


def test_the_answer_does_not_move_under_a_1e_9_jitter():
    a = choose(isoflop_grid())
    b = choose(isoflop_grid(jitter=1e-9))
    assert a.chosen == b.chosen
    for which in ("2", "3"):
        x, y = a.models[which].at(TARGET), b.models[which].at(TARGET)
        assert np.allclose(x, y, rtol=1e-6), which
        assert a.scores[which] == pytest.approx(b.scores[which], rel=1e-4, abs=1e-7)


ANSWER = """
import json, sys
from pretrain.analysis.optimal_choice import fit_approach
from pretrain.analysis.runs import RunPoint
pts = [RunPoint(str(i), n, d, 6 * n * d, x, fields={"budget": b})
       for i, (n, d, x, b) in enumerate(json.loads(sys.argv[1]))]
print(json.dumps([list(fit_approach(w, pts).at(float(sys.argv[2]))) for w in ("2", "3")]))
"""


def _x86_kernels() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return ["Sandybridge"] + (["Haswell"] if " avx2" in flags else [])


@pytest.mark.skipif(len(_x86_kernels()) < 2, reason="needs an x86 CPU with AVX2")
def test_the_answer_is_the_same_under_other_openblas_kernels():
    grid = json.dumps([[p.n_params, p.tokens, p.loss, p.fields["budget"]]
                       for p in isoflop_grid()])
    answers = []
    for kernel in _x86_kernels():
        env = {**os.environ, "OPENBLAS_CORETYPE": kernel}
        out = subprocess.run([sys.executable, "-c", ANSWER, grid, repr(float(TARGET))], env=env,
                             capture_output=True, text=True, check=True, timeout=120)
        answers.append(json.loads(out.stdout))
    assert np.allclose(answers[0], answers[1], rtol=1e-9)


def write_csv(path: Path, points: list[RunPoint]) -> Path:
    lines = ["name,n_params,tokens,loss,budget"] + [
        f"{p.name},{float(p.n_params)!r},{float(p.tokens)!r},{float(p.loss)!r},"
        f"{p.fields.get('budget', '')}" for p in points]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_tool_prints_one_line_per_budget_and_records_it(tmp_path, capsys):
    csv = write_csv(tmp_path / "grid.csv", isoflop_grid())
    assert scaling_law.main(["--points", str(csv), "--predict-optimal", f"{TARGET:g}",
                             "--predict-optimal", "1e21", "--bootstrap", "20", "--no-plots",
                             "--out", str(tmp_path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("C=")]
    assert len(lines) == 2 and all(" [" in ln and "at N=" in ln and "(approach " in ln
                                   for ln in lines)
    optimal = json.loads((tmp_path / "fit.json").read_text())["optimal"]
    assert [b["flops"] for b in optimal["budgets"]] == [TARGET, 1e21]
    assert optimal["chosen"] in ("2", "3")


def test_a_ladder_without_iso_flop_budgets_and_a_degenerate_law_is_refused(tmp_path, capsys):
    """Every run at 20 tokens per parameter: no budget has 3 sizes, and L(N, D) cannot tell
    N from D."""
    pts = []
    for n in np.geomspace(1e7, 1e9, 8):
        d = 20 * n
        pts.append(RunPoint(f"n{n:.3g}", n, d, 6 * n * d, float(CHINCHILLA.predict(n, d))))
    csv = write_csv(tmp_path / "ladder.csv", pts)
    assert scaling_law.main(["--points", str(csv), "--predict-optimal", "1e22", "--bootstrap",
                             "0", "--no-plots", "--out", str(tmp_path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("C=")]
    assert len(lines) == 1 and "REFUSED, not a prediction" in lines[0]
    assert "loss " not in lines[0].split("REFUSED")[0]
    optimal = json.loads((tmp_path / "fit.json").read_text())["optimal"]
    assert optimal["chosen"] is None and "refused" in optimal["budgets"][0]
    assert len(usable(budgets(pts))) == 0
