"""The committed ladder (docs/ladder/) can be checked from a clean clone: its fit re-predicts
the preregistered held-out point in one command, a rerun rung is compared with its committed
figure, and the files hold what issue 55 asks of them."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
from helpers import REPO

from pretrain.tools import ladder_check

LADDER = REPO / "docs" / "ladder"


def test_the_committed_fit_repredicts_the_preregistered_point(capsys):
    held = json.loads((LADDER / "heldout.json").read_text())
    rc = ladder_check.main(["predict", f"{held['n_params']},{held['tokens']}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"loss {held['predicted']:.4f}" in out and held["form"] in out
    assert held["ratio"] >= 30 and held["flops"] >= 3e14
    low, high = held["interval"]
    assert low < held["predicted"] < high


def test_the_committed_runs_are_the_fit_runs():
    rows = list(csv.DictReader(open(LADDER / "runs.csv")))
    fit = json.loads((LADDER / "fit.json").read_text())
    assert len(rows) == len(fit["runs"])
    # the fit policy's choice fits the runs of at least its tokens per parameter
    least = fit["chosen"]["min_tokens_per_param"]
    assert fit["chosen"]["runs"] == sum(int(r["tokens"]) >= least * (1 - 1e-6) * int(r["n_params"])
                                        for r in rows)
    assert {"width", "seed", "tokens", "steps", "batch", "lr", "final_val_loss"} <= set(rows[0])
    assert sorted(float(r["final_val_loss"]) for r in rows) == \
        pytest.approx(sorted(p["loss"] for p in fit["runs"]))


def test_a_rerun_rung_is_compared_with_its_committed_figure(tmp_path, capsys):
    row = next(r for r in csv.DictReader(open(LADDER / "runs.csv"))
               if r["width"] == "24" and r["tokens_per_param"] == "48.0")
    run = tmp_path / "model.d_model=24"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(
        "train:\n  seed: 1337\noptim:\n  betas: [0.9, 0.99]\n")
    plan = {"n_params": int(row["n_params"]), "tokens": int(row["tokens"]), "width": 24,
            "global_batch_tokens": 128, "lr": 0.0025}
    (run / "plan.json").write_text(json.dumps(plan))
    for loss, code in ((float(row["final_val_loss"]) * 1.002, 0),
                       (float(row["final_val_loss"]) * 1.05, 1)):
        (run / "result.json").write_text(json.dumps({"final_val_loss": loss, "steps": 1,
                                                     "tokens": int(row["tokens"])}))
        assert ladder_check.main(["rung", str(run)]) == code
    out = capsys.readouterr().out
    assert "within it" in out and "OUTSIDE it" in out
    shutil.rmtree(run)
    assert ladder_check.main(["rung", str(run)]) == 2
