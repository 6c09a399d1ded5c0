"""Two ladders trained at scale by others, with the runs their papers held out
(docs/ladder/published.md): the fit policy predicts all eight held-out runs within the
issue's bar (mean |error| <= 1.5%, none over 3%) from the ladder alone, each figure the one
documented; the plain Chinchilla fit reproduces the OLMo paper's own (-1.98%, -3.83%); a
degenerate fit is refused in one line.

Every figure is checked to SPREAD, the 0.05 percentage points issue 68 allows between BLAS
kernels (measured: the figures agree to 1e-6 under OPENBLAS_CORETYPE Haswell, Zen, SkylakeX
and Sandybridge, docs/ladder/published.md; tests/test_fit_stability.py checks the decisions
under other kernels, jitter and twice the starts)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy", reason="the analysis extra: pip install -e '.[analysis]'")

from pretrain.analysis.fitting import fit  # noqa: E402
from pretrain.analysis.laws import Law  # noqa: E402
from pretrain.analysis.policy import degenerate  # noqa: E402
from pretrain.analysis.runs import RunPoint, read_points  # noqa: E402
from pretrain.analysis.scaling import isoflop_minimum, isoflop_problem  # noqa: E402
from pretrain.tools import scaling_law  # noqa: E402

PUBLISHED = Path(__file__).resolve().parents[1] / "docs" / "ladder" / "published"
DOC = PUBLISHED.parent / "published.md"
OLMO_LADDER = "(190M|370M|760M|1B)-(1|2|5|10)xC"
SPREAD = 0.05  # percentage points: what a figure may move by between machines (issue 68)

# table -> (selection flags, {held-out run: (policy's error %, plain Chinchilla's error %)})
TABLES = {
    "rpj": (["gadre2024", "--select", "dataset=rpj", "--max-flops", "2.04e19"],
            {"rpj-open_lm_7b-1.0": (0.64, -2.40), "rpj-open_lm_1b-32.0": (0.56, -0.54)}),
    "c4_original": (["gadre2024", "--select", "dataset=c4_original", "--max-flops", "2.04e19"],
                    {"c4_original-open_lm_1b-4.0": (2.08, 0.85),
                     "c4_original-open_lm_7b-1.0": (-2.96, -5.54)}),
    "rw_original": (["gadre2024", "--select", "dataset=rw_original", "--max-flops", "2.04e19"],
                    {"rw_original-open_lm_1b-16.0": (0.27, -0.33),
                     "rw_original-open_lm_7b-1.0": (-1.27, -4.52)}),
    "olmo": (["olmo2024", "--ladder", OLMO_LADDER],
             {"peteish7_eval_anneal": (-1.33, -1.98), "peteish13_eval_final": (-2.73, -3.83)}),
}


def args_for(table: str) -> tuple[list[str], dict]:
    flags, targets = TABLES[table]
    csv = PUBLISHED / flags[0] / "runs.csv"
    held = [x for name in targets for x in ("--heldout", name.replace(".", r"\."))]
    # 50 resamples, not the command's 200: the figures checked are point predictions, and the
    # intervals still cover each held-out run by 2.5-8.3 points (measured; 3 s a table, not 5-12)
    return ["--points", str(csv), *flags[1:], *held, "--policy", "--no-plots",
            "--bootstrap", "50"], targets


@pytest.mark.parametrize("table", list(TABLES))
def test_the_policy_predicts_the_held_out_runs_as_documented(table, tmp_path):
    args, targets = args_for(table)
    assert scaling_law.main([*args, "--out", str(tmp_path)]) == 0
    policy = json.loads((tmp_path / "fit.json").read_text())["policy"]
    held = {h["name"]: h for h in policy["heldout"]}
    assert set(held) == set(targets)
    doc = DOC.read_text()
    for name, (expected, _) in targets.items():
        h = held[name]
        assert 100 * h["error"] == pytest.approx(expected, abs=SPREAD), name
        assert f"{expected:+.2f}%" in doc, f"{name}: published.md lacks {expected:+.2f}%"
        assert h["covered"] and h["interval"][0] < h["loss"] < h["interval"][1]
    # chosen by the ladder's backtest alone: the held-out runs are not in what it fitted
    assert not set(targets) & set(policy["ladder"])


def test_the_eight_errors_meet_the_bar():
    errors = [abs(e) for _, t in TABLES.values() for e, _ in t.values()]
    assert len(errors) == 8 and np.mean(errors) <= 1.5 and max(errors) <= 3.0
    baseline = [abs(b) for _, t in TABLES.values() for _, b in t.values()]
    assert np.mean(baseline) == pytest.approx(2.50, abs=SPREAD)


@pytest.mark.parametrize("table", list(TABLES))
def test_the_plain_chinchilla_fit_gives_the_documented_baseline(table):
    """Hoffmann et al.'s fit with an exact gradient: on the OLMo ladder it gives the paper's
    -1.98% and -3.83% (a fit that differences numerically gives -0.27% and +1.20%)."""
    flags, targets = TABLES[table]
    points = read_points(PUBLISHED / flags[0] / "runs.csv")
    if table == "olmo":
        import re

        ladder = [p for p in points if re.fullmatch(OLMO_LADDER, p.name)]
    else:
        ladder = [p for p in points if p.fields["dataset"] == table and p.flops <= 2.04e19]
    law = fit("chinchilla", [p.n_params for p in ladder], [p.tokens for p in ladder],
              [p.loss for p in ladder]).law
    for p in points:
        if p.name in targets:
            error = 100 * (float(law.predict(p.n_params, p.tokens)) / p.loss - 1)
            assert error == pytest.approx(targets[p.name][1], abs=SPREAD), p.name


def off_optimum_isoflop(seed: int = 0) -> list[RunPoint]:
    """Iso-FLOP budgets whose sizes run far from each budget's optimum, the small sizes in a
    regime of their own (the loss climbs steeply below 1/4 of N_opt): the shape that made
    L(N, D) put E under the lowest loss with both exponents near 1."""
    rng = np.random.default_rng(seed)
    pts = []
    for c in (1e17, 3e17, 1e18, 3e18):
        n_opt = (c / 120) ** 0.5
        for k in (1 / 30, 1 / 10, 1 / 3, 1, 3, 10):
            n = n_opt * k
            d = c / (6 * n)
            base = 1.8 + 400 / n**0.34 + 400 / d**0.28
            loss = base * (1 + 0.9 * max(0.0, math.log(0.25 / k)) ** 2)
            pts.append(RunPoint(f"C{c:.0e}-k{k:.3g}", n, d, c, loss * (1 + 0.002 *
                                                                         rng.standard_normal())))
    return pts


def test_a_degenerate_fit_is_refused_in_one_line(tmp_path, capsys):
    csv = tmp_path / "isoflop.csv"
    csv.write_text("name,n_params,tokens,loss\n" + "".join(
        f"{p.name},{p.n_params},{p.tokens},{p.loss}\n" for p in off_optimum_isoflop()))
    out = tmp_path / "fit"
    assert scaling_law.main(["--points", str(csv), "--bootstrap", "20", "--no-plots",
                             "--out", str(out)]) == 0
    text = capsys.readouterr().out
    refused = [ln for ln in text.splitlines() if "L(N, D): REFUSED, not a prediction" in ln]
    assert len(refused) == 1 and ("used instead" in refused[0] or "no fit" in refused[0])
    fit_json = json.loads((out / "fit.json").read_text())
    assert "refused" in fit_json["chinchilla_law"]
    assert fit_json["extrapolation"]["L(N, D)"][0].startswith("refused: ")
    for m in fit_json.get("isoflop_minima", []):  # no nonsense minima
        assert "none" in m or (m["n_opt"] > 0 and m["loss"] > 0)


def test_degenerate_names_each_reason():
    runs = [RunPoint(f"r{i}", n, d, 6 * n * d, 3.0 + 100 / n**0.3 + 100 / d**0.3)
            for i, (n, d) in enumerate((n, 20 * n * k) for n in (1e6, 3e6, 1e7)
                                       for k in (0.5, 1, 2))]
    low = min(p.loss for p in runs)
    good = Law("chinchilla", {"E": 3.0, "A": 100, "B": 100, "alpha": 0.3, "beta": 0.3})
    assert degenerate(good, runs) is None
    floor = Law("chinchilla", {**good.constants, "E": low})
    assert "lowest loss of its own runs" in degenerate(floor, runs)
    steep = Law("chinchilla", {**good.constants, "alpha": 1.6})
    assert "outside [0.02, 1]" in degenerate(steep, runs)
    assert "runs for its 5 constants" in degenerate(good, runs[:6])


def test_isoflop_minimum_only_inside_the_sizes():
    def group(losses):
        return [RunPoint(f"n{n}", n, 1e9 / n, 6e9, x) for n, x in zip((1e6, 2e6, 4e6), losses,
                                                                        strict=True)]

    assert isoflop_minimum(group([3.0, 2.9, 3.0])) is not None
    assert "opens downward" in isoflop_problem(group([3.0, 3.1, 3.0]))
    assert isoflop_minimum(group([3.3, 3.1, 3.0])) is None
    assert "outside the sizes trained" in isoflop_problem(group([3.3, 3.1, 3.0]))


def test_one_fitter_one_bootstrap_each_law_once():
    """Every scaling-law fit goes through analysis/fitting.py (the only optimizer call and
    the only resampling of runs) and every formula lives in analysis/laws.py."""
    src = Path(__file__).resolve().parents[1] / "src" / "pretrain"
    texts = {p: p.read_text() for p in src.rglob("*.py")}
    optimizers = [p.name for p, t in texts.items() if "scipy.optimize" in t]
    assert optimizers == ["fitting.py"]
    resamplers = [p.name for p, t in texts.items() if "def bootstrap" in t]
    assert resamplers == ["fitting.py"]
    formulas = [p.name for p, t in texts.items() if "/ n**" in t or "/ d**" in t
                or "n ** -" in t]
    assert formulas == [], f"a law written outside analysis/laws.py: {formulas}"
    from pretrain.analysis.scaling import ChinchillaLaw

    law = ChinchillaLaw(E=1.7, A=400.0, B=410.0, alpha=0.34, beta=0.28)
    same = Law("chinchilla", vars(law)).predict(1e9, 2e10)
    assert float(law.predict(1e9, 2e10)) == pytest.approx(float(same), rel=1e-12)


def test_the_same_fit_again_is_the_first_ones_and_the_caller_may_change_it(monkeypatch):
    """fitting.fit answers a repeated call from its cache (the policy's backtests repeat a
    sixth of their fits): the same law, a fresh copy each time, and new arguments (other
    runs, a fixed constant, other starts) fit anew."""
    from pretrain.analysis import fitting

    monkeypatch.setattr(fitting, "_FITS", type(fitting._FITS)())
    calls = []
    real = fitting._fit
    monkeypatch.setattr(fitting, "_fit", lambda *a, **k: calls.append(a) or real(*a, **k))
    pts = off_optimum_isoflop()
    n, d, loss = ([getattr(p, f) for p in pts] for f in ("n_params", "tokens", "loss"))
    first = fit("chinchilla", n, d, loss)
    first.theta[:] = 0.0
    first.law.constants["E"] = -1.0
    again = fit("chinchilla", n, d, loss)
    assert len(calls) == 1 and again.law.constants["E"] > 0 and again.theta.any()
    assert again.law == fit("chinchilla", list(n), list(d), list(loss)).law and len(calls) == 1
    fit("chinchilla", n, d, [x * 1.001 for x in loss])
    fit("chinchilla", n, d, loss, fixed={"e": math.log(1.8)})
    fit("chinchilla", n, d, loss, keep=1, starts=again.theta[None, :])
    assert len(calls) == 4
