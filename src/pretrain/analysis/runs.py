"""The finished runs of a sweep as points (N, D, C, loss) for the scaling-law fits: which runs
count, what N counts (``COUNTS``), and which runs are left out (too short, the worst K).

Units: N is ``plan.json``'s ``n_params_active`` unless a count says otherwise, D the tokens
trained, C = 6 N D (``budget.run_compute``, the plan's ``compute`` for the total count).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.analysis.corpus import corpus_tokens
from pretrain.budget.compute import FLOPS_PER_PARAM_TOKEN, run_compute

# -- the compute of a run -------------------------------------------------------------------

# C = 6 N D is budget.run_compute: the one definition of a run's compute.


@dataclass(frozen=True)
class RunPoint:
    """One finished run of a sweep: what it cost and the loss it reached."""

    name: str
    n_params: float
    tokens: float
    flops: float
    loss: float
    # fresh tokens of the corpus the run read (analysis/corpus.py); None: unknown
    data_tokens: float | None = None
    # optimizer steps from the start (a branch's include its source's); None: unknown
    steps: int | None = None
    # N in other counts than the one fitted ("non_embedding", "flops"), where known: the
    # fit policy tries each (analysis/policy.py)
    counts: dict[str, float] = field(default_factory=dict)
    # a table's other columns (dataset, lr, ...), to select the ladder with
    fields: dict[str, str] = field(default_factory=dict)

    def count(self, name: str) -> float | None:
        """N in the count ``name`` (``total`` is ``n_params``); None when not known."""
        return self.n_params if name == "total" else self.counts.get(name)

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.n_params


# -- collecting runs ------------------------------------------------------------------------


def finished_runs(root: Path | str, key="final_val_loss") -> Iterator[tuple[Path, dict, dict]]:
    """(run dir, plan, result) of every finished run under ``root``: a directory holding
    ``result.json`` (written only when a run finished its budget) with a finite, positive
    ``key`` (the fitted metric) and a ``plan.json`` beside it; a diverged run is left out."""
    for result_path in sorted(Path(root).rglob("result.json")):
        plan_path = result_path.with_name("plan.json")
        if not plan_path.exists():
            continue
        result, plan = json.loads(result_path.read_text()), json.loads(plan_path.read_text())
        loss = result.get(key)
        if loss is None or not math.isfinite(loss) or loss <= 0:
            continue
        yield result_path.parent, plan, result


TABLE_COUNTS = {"n_params_non_embedding": "non_embedding", "flops_per_token": "flops"}


def read_points(path: Path | str) -> list[RunPoint]:
    """Published or other outside runs from a CSV file with the columns ``n_params``,
    ``tokens`` and ``loss`` (or ``final_val_loss``; lines starting with ``#`` are comments,
    for the source);
    C = 6 N D as for this project's runs. Optional columns: ``name``, ``steps``,
    ``n_params_non_embedding`` and ``flops_per_token`` (other counts of N the fit policy may
    try), and any others (a group such as ``dataset``, ``lr``), kept to select rows with."""
    import csv

    lines = [ln for ln in Path(path).read_text().splitlines() if not ln.startswith("#")]
    rows = list(csv.DictReader(lines))
    for r in rows:  # this project's runs.csv (tools/ladder_check.py export) names them so
        r.setdefault("loss", r.get("final_val_loss"))
        r.setdefault("name", r.get("run"))
    missing = {"n_params", "tokens", "loss"} - {k for k, v in (rows[0] if rows else {}).items()
                                                if v is not None}
    if missing:
        raise ValueError(f"{path}: needs the columns n_params, tokens, loss (missing "
                         f"{', '.join(sorted(missing))})")
    points = []
    for i, r in enumerate(rows):
        n, d = float(r["n_params"]), float(r["tokens"])
        counts = {name: float(r[col]) for col, name in TABLE_COUNTS.items() if r.get(col)}
        if "flops" in counts:  # per-token training FLOPs -> the N that makes C = 6 N D
            counts["flops"] /= FLOPS_PER_PARAM_TOKEN
        points.append(RunPoint(
            r.get("name") or f"{Path(path).stem}:{i}", n, d, run_compute(n, d), float(r["loss"]),
            steps=int(float(r["steps"])) if r.get("steps") else None, counts=counts,
            fields={k: v for k, v in r.items() if k and v is not None}))
    return points


def without_short_runs(points: list[RunPoint], min_steps: int) -> tuple[list[RunPoint],
                                                                         list[RunPoint]]:
    """(kept, left out): runs of fewer than ``min_steps`` optimizer steps are left out. A run
    of a few dozen steps is still in its warm-up transient, not on the power law that the
    long runs follow: in the byte ladder (docs/benchmarks.md) the smallest width's 26-step
    point sat 16% below L(N, D) and pulled the fit's data term; published ladders run
    thousands of steps even at their smallest size."""
    if min_steps <= 0:
        return list(points), []
    short = [p for p in points if p.steps is not None and p.steps < min_steps]
    return [p for p in points if p not in short], short


def without_highest_losses(points: list[RunPoint], k: int) -> list[RunPoint]:
    """``points`` less the ``k`` with the highest loss (Besiroglu et al. 2024 leave out
    Chinchilla's 5 highest before fitting)."""
    if k <= 0:
        return list(points)
    cut = sorted(p.loss for p in points)[-k]
    return [p for p in points if p.loss < cut]


COUNTS = ("total", "non_embedding", "flops")


def plan_params(plan: dict, count: str = "total") -> float:
    """N of a run's plan.json in one of ``COUNTS``: ``total`` the active parameters (every
    one for a dense model), ``non_embedding`` those less the embedding tables, ``flops`` the
    per-token training FLOPs over 6."""
    if count == "total":
        return float(plan.get("n_params_active", plan["n_params"]))  # = n_params when dense
    if count == "non_embedding":
        inactive = plan["n_params"] - plan.get("n_params_active", plan["n_params"])
        return float(plan["n_params_non_embedding"] - inactive)
    if count == "flops":
        return plan["flops_per_token"] / FLOPS_PER_PARAM_TOKEN
    raise ValueError(f"count {count!r}: use one of {', '.join(COUNTS)}")


def _has_count(plan: dict, count: str) -> bool:
    return {"non_embedding": "n_params_non_embedding", "flops": "flops_per_token"}[count] in plan


def collect_runs(root: Path | str, key: str = "final_val_loss",
                 count: str = "total") -> list[RunPoint]:
    """Every finished run under ``root``: a directory holding ``result.json`` (written only
    when a run finished its budget) with ``key`` (the loss: the metric fitted; or
    ``final_val_bpb``) and a ``plan.json`` beside it; N in ``count`` (``plan_params``).
    C is ``run_compute`` of that N and the tokens trained (the plan's own ``compute`` for
    the total count)."""
    root, points = Path(root), []
    for run_dir, plan, result in finished_runs(root, key):
        n = plan_params(plan, count)
        d = float(result.get("tokens") or plan["tokens"])
        name = str(run_dir.relative_to(root)) if run_dir != root else root.name
        others = {c: plan_params(plan, c) for c in COUNTS if c not in (count, "total")
                  and _has_count(plan, c)}
        points.append(RunPoint(name=name, n_params=n, tokens=d, flops=run_compute(n, d),
                               loss=float(result[key]),
                               data_tokens=corpus_tokens(plan), steps=plan.get("steps"),
                               counts=others))
    return points
