"""The ladder's backtest (pretrain/analysis/backtest.py, ``tools/scaling_law.py --backtest R``):
fit the runs at or under 1/R of the largest compute, predict the rest, per candidate of the fit
policy (analysis/policy.py); the policy's choice and interval (analysis/prediction.py); and
``tools/ladder.py --plan`` refusing a held-out ratio the ladder cannot test on itself."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_ladder_design import design

from pretrain.analysis.backtest import TOLERANCE, backtest, max_ratio
from pretrain.analysis.ladder_design import problems, render
from pretrain.analysis.policy import Candidate
from pretrain.analysis.prediction import choose, predict
from pretrain.analysis.runs import RunPoint
from pretrain.tools import scaling_law

WIDTHS = (16, 24, 32, 48, 60, 72)
TPP = (3, 6, 12, 24, 48)


def ladder(law, bend: float = 0.0, noise: float = 0.0, seed: int = 0) -> list[RunPoint]:
    """A byte-ladder-shaped set of runs whose loss is ``law(N, D)``, times (1 + bend) at the
    smallest sizes falling off as 1/N (a regime the top rungs are not in), with noise."""
    rng = np.random.default_rng(seed)
    pts = []
    for w in WIDTHS:
        n = 48 * w * w + 257 * w
        for t in TPP:
            d = t * n
            loss = law(n, d) * (1 + bend * (17_000 / n)) * (1 + noise * rng.standard_normal())
            pts.append(RunPoint(f"w{w}t{t}", n, d, 6 * n * d, float(loss)))
    return pts


def chinchilla(n, d):
    return 0.6 + 40.0 / n**0.3 + 60.0 / d**0.28


def test_a_ladder_that_follows_its_law_passes_its_backtest():
    bt = backtest(ladder(chinchilla), 30)
    assert bt.cut == pytest.approx(max(p.flops for p in ladder(chinchilla)) / 30)
    chin = next(r for r in bt.results if r.candidate == Candidate("chinchilla"))
    assert chin.fitted >= 6 and chin.top and abs(chin.top_mean) < 0.005
    assert bt.supported and bt.best.top_mae < 0.005
    # every predicted run is above the cut, every top rung within 2x of the largest compute
    top_c = max(p.flops for p in ladder(chinchilla))
    assert all(p.flops > bt.cut for p, _ in chin.errors)
    assert all(p.flops >= top_c / 2 for p, _ in chin.top)


def test_small_rungs_in_another_regime_fail_the_backtest_of_the_plain_law():
    bent = ladder(chinchilla, bend=0.15)
    bt = backtest(bent, 30, [Candidate("chinchilla"), Candidate("shared")])
    chin = bt.results[0]
    # the small rungs are pessimistic: extrapolated from them, the top is predicted too high
    assert chin.top_mean > TOLERANCE
    assert not bt.supported


def test_a_ratio_the_runs_cannot_test_is_refused_with_the_ratio_they_allow():
    pts = ladder(chinchilla)
    can = max_ratio([p.flops for p in pts], [p.n_params for p in pts], [p.tokens for p in pts])
    assert 30 < can < 1e4
    with pytest.raises(ValueError, match=f"allow a backtest up to {can:.3g}x"):
        backtest(pts, can * 2)


def test_the_prediction_of_the_chosen_candidate_has_an_interval_around_the_truth():
    pts = ladder(chinchilla, noise=0.003, seed=1)
    n, d = 1.28e6, 4.1e7
    choice = choose(pts)
    assert choice.chosen is not None and choice.chosen.refused is None
    [pr] = predict(choice, pts, [RunPoint("target", n, d, 6 * n * d, chinchilla(n, d))],
                   resamples=12)
    assert pr.loss == pytest.approx(chinchilla(n, d), rel=0.03)
    assert pr.interval[0] <= pr.loss <= pr.interval[1] and pr.covered


def test_scaling_law_tool_prints_the_backtest_and_records_it(tmp_path, capsys):
    csv = tmp_path / "runs.csv"
    csv.write_text("n_params,tokens,loss\n" + "".join(
        f"{p.n_params},{p.tokens},{p.loss}\n" for p in ladder(chinchilla)))
    out = tmp_path / "fit"
    rc = scaling_law.main(["--points", str(csv), "--backtest", "30", "--bootstrap", "0",
                           "--predict", "1.28e6,4.1e7", "--no-plots", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "backtest at 30x" in text and "SUPPORTED: " in text
    fit = json.loads((out / "fit.json").read_text())
    assert fit["backtest"]["supported"] is True and fit["backtest"]["ratio"] == 30
    assert {f["candidate"] for f in fit["backtest"]["candidates"]} == {
        f"{form}, N total, {data}" for form in ("chinchilla", "shared")
        for data in ("all runs", "tpp>=10")}
    assert fit["chosen"]["form"] in ("chinchilla", "shared")
    pred = fit["backtest"]["predict"][0]
    assert pred["loss"] == pytest.approx(chinchilla(1.28e6, 4.1e7), rel=0.01)
    low, high = pred["interval"]
    assert low < pred["loss"] < high


def test_scaling_law_tool_refuses_an_untestable_ratio_in_one_line(tmp_path, capsys):
    csv = tmp_path / "runs.csv"
    csv.write_text("n_params,tokens,loss\n" + "".join(
        f"{p.n_params},{p.tokens},{p.loss}\n" for p in ladder(chinchilla)))
    rc = scaling_law.main(["--points", str(csv), "--backtest", "1e6", "--bootstrap", "0",
                           "--no-plots", "--out", str(tmp_path / "fit")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "allow a backtest up to" in err[0]


def test_plan_states_the_backtest_ratio_and_refuses_a_heldout_beyond_it():
    d = design(ratio=30.0)
    can = d.backtest_ratio
    assert math.isfinite(can) and can > 1
    assert f"allow one up to {can:.3g}x" in render(d, "r", "muP")
    far = design(ratio=can * 3)
    found = [p for p in problems(far) if "cannot be backtested" in p]
    assert found and f"up to {far.backtest_ratio:.3g}x" in found[0]
