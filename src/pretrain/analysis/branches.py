"""A ladder's runs and its cooldown branches as (N, D) points for the L(N, D) fit.

A pure ladder (D = k N for every size) cannot separate A/N^alpha from B/D^beta
(``scaling.check_identifiable``). Cooldown branches (checkpoint/branch.py) fix that at the
price of a decay each: every size's long WSD run stores branch points at several tokens per
parameter, each branch decays from one, and each branch's final validation loss is the loss
of a run of its own D (Hägele et al. 2024). So one ladder of S sizes with K branches each
gives S (K + 1) points at K + 1 ratios D/N.

What is left out: a run whose LR never decayed (``schedule.decay=constant``, a stable run
stored only to branch from): its last loss is not what a run of that D reaches. It ends
at its peak LR: ``final_lr`` in result.json against the plan's ``lr``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pretrain.analysis.runs import RunPoint, collect_runs, finished_runs

# A run whose last LR is within this fraction of its peak ended at the peak: it did not
# cool down. Anything lower decayed, or ended inside its warmup (a run too short to leave
# it, whose loss is still its own D's).
AT_PEAK = 1e-3


def cooled_down(plan: dict, result: dict) -> bool:
    """Whether a finished run ended below its peak LR (runs from before result.json
    recorded ``final_lr`` count as decayed: every schedule but ``constant`` decays)."""
    final, peak = result.get("final_lr"), plan.get("lr")
    return final is None or not peak or final < (1 - AT_PEAK) * peak


@dataclass(frozen=True)
class Collected:
    points: list[RunPoint]  # every cooled-down run: from-scratch runs and branches alike
    branches: dict[str, dict]  # point name -> its result.json's "branch" (source, step)
    stable: list[str]  # runs left out: they never decayed


def _cooled(root: Path, key: str) -> tuple[dict[str, dict | None], list[str]]:
    """Under ``root``: {point name: its branch record or None} of the runs that cooled
    down, and the run directories that never did."""
    keep, stable = {}, []
    for run_dir, plan, result in finished_runs(root, key):
        name = str(run_dir.relative_to(root)) if run_dir != root else root.name
        if cooled_down(plan, result):
            keep[name] = result.get("branch")
        else:
            stable.append(str(run_dir))
    return keep, stable


def collect_cooldowns(roots: Sequence[Path | str], key: str = "final_val_loss",
                      count: str = "total") -> Collected:
    """Every finished run under ``roots`` that cooled down, as an (N, D) point (N the plan's
    parameters in ``count``, runs.COUNTS, D the tokens it trained, counted from the start
    of its source for a branch), and which of them are branches; ``key``: the result.json
    metric fitted."""
    points, branches, stable = [], {}, []
    for root in map(Path, roots):
        keep, left_out = _cooled(root, key)
        stable += left_out
        points += [p for p in collect_runs(root, key, count) if p.name in keep]
        branches.update({name: b for name, b in keep.items() if b})
    return Collected(points, branches, stable)


def describe(collected: Collected) -> list[str]:
    """What was collected, in lines for the tool's output."""
    c = collected
    lines = [f"{len(c.points)} cooled-down runs, {len(c.branches)} of them cooldown branches "
             f"(from {len({b['source'] for b in c.branches.values()})} source runs)"]
    lines += [f"left out (never decayed, final LR at its peak): {s}" for s in c.stable]
    return lines
