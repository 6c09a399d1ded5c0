"""docs/ladder/published/ladders.toml: every ladder's table is there with its source's
license beside it, has the columns a fit reads, names its held-out and compute-optimal runs
as they are in the table, and holds each held-out run above the largest compute (6ND) of the
runs its flags leave to fit."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import pytest

from pretrain.analysis.runs import read_points
from pretrain.tools.fit_policy import add_arguments, select

PUBLISHED = Path(__file__).resolve().parents[1] / "docs" / "ladder" / "published"
LADDERS = tomllib.loads((PUBLISHED / "ladders.toml").read_text())["ladder"]
REQUIRED = {"name", "n_params", "tokens", "loss"}
DESIGNS = {"overtrained grid", "iso-FLOP grid", "width x depth", "sizes at one LR",
           "chinchilla-style sizes"}


def columns(table: Path) -> set[str]:
    header = next(ln for ln in table.read_text().splitlines() if not ln.startswith("#"))
    return set(header.split(","))


def fit_set_and_heldout(ladder: dict) -> tuple[list, list]:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    held = [x for name in ladder["heldout"] for x in ("--heldout", re.escape(name))]
    args = ap.parse_args([*ladder["flags"], *held])
    return select(read_points(PUBLISHED / ladder["table"]), args)


def test_the_ladders_have_unique_names_and_the_four_existing_come_first():
    names = [lad["name"] for lad in LADDERS]
    assert len(names) == len(set(names))
    assert names[:4] == ["rpj", "c4_original", "rw_original", "olmo"]


@pytest.mark.parametrize("ladder", LADDERS, ids=lambda lad: lad["name"])
def test_the_table_is_there_with_its_source_and_license(ladder):
    table = PUBLISHED / ladder["table"]
    assert table.is_file()
    assert (table.parent / "LICENSE").is_file()
    comments = [ln for ln in table.read_text().splitlines() if ln.startswith("#")]
    assert any("commit" in ln for ln in comments), "the # lines name no source commit"
    assert REQUIRED <= columns(table)
    assert ladder["source"] and ladder["dataset"] and ladder["loss_on"]
    design = ladder["design"]
    assert design in DESIGNS or design.startswith("other"), design


@pytest.mark.parametrize("ladder", LADDERS, ids=lambda lad: lad["name"])
def test_the_held_out_runs_exist_and_lie_above_the_fit_set(ladder):
    names = {p.name for p in read_points(PUBLISHED / ladder["table"])}
    targets = set(ladder["heldout"]) | {o["run"] for o in ladder.get("optimal", [])}
    assert targets <= names, sorted(targets - names)
    fit_set, heldout = fit_set_and_heldout(ladder)
    assert {p.name for p in heldout} == set(ladder["heldout"])
    assert not {p.name for p in fit_set} & targets
    largest = max(p.flops for p in fit_set)
    for p in heldout:
        assert p.flops > largest, f"{p.name}: {p.flops:.3g} <= the fit set's {largest:.3g}"


@pytest.mark.parametrize("ladder", [lad for lad in LADDERS if "optimal" in lad],
                         ids=lambda lad: lad["name"])
def test_each_optimal_target_is_the_lowest_loss_of_its_budget(ladder):
    points = read_points(PUBLISHED / ladder["table"])
    fit_set, _ = fit_set_and_heldout(ladder)
    group = {p.name: p.fields.get("dataset") for p in fit_set}
    groups = set(group.values())
    for o in ladder["optimal"]:
        budget = [p for p in points if float(p.fields["budget"]) == o["budget"]
                  and p.fields.get("dataset") in groups]
        assert min(budget, key=lambda p: p.loss).name == o["run"]
        assert o["budget"] > max(float(p.fields["budget"]) for p in fit_set)
