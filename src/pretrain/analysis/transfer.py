"""Does the best learning rate transfer across width? (``tools/scaling_law.py --transfer``)

Reads a width x learning-rate sweep (recipes/transfer-tiny.yaml): every finished run's
parametrisation and width (the plan's ``parametrization`` and ``width``), peak LR and final
validation loss. For each parametrisation and width the best LR is the vertex of a quadratic
in log lr through the grid's best run and its two neighbours (the grid's best itself when
it lies on the grid's edge, or the three points curve the wrong way); the drift is how far
that optimum moves from the smallest width to the largest, in grid steps (the grid's LR
ratio, 2 in the recipe). Under muP it should stay within one step; under the standard
parametrisation it moves to smaller LRs as the width grows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pretrain.analysis.runs import finished_runs


@dataclass(frozen=True)
class TransferPoint:
    parametrization: str
    width: int
    lr: float
    loss: float


@dataclass(frozen=True)
class WidthOptimum:
    width: int
    lr: float
    loss: float
    how: str  # "quadratic" or "grid"
    edge: bool  # the grid's best is its smallest or largest LR: the optimum may lie beyond


def collect_transfer(root: Path | str) -> list[TransferPoint]:
    """Every finished run under ``root`` whose plan records its width and parametrisation."""
    points = []
    for _, plan, result in finished_runs(root):
        if "width" not in plan or "parametrization" not in plan:
            continue  # written before plans recorded them
        points.append(TransferPoint(str(plan["parametrization"]), int(plan["width"]),
                                    float(plan["lr"]), float(result["final_val_loss"])))
    return points


def best_lr(points: Sequence[TransferPoint]) -> WidthOptimum:
    """The best LR of one width's runs (see the module's docstring)."""
    pts = sorted(points, key=lambda p: p.lr)
    i = min(range(len(pts)), key=lambda k: pts[k].loss)
    edge = i in (0, len(pts) - 1)
    if not edge:
        x = np.log([p.lr for p in pts[i - 1:i + 2]])
        a, b, c = np.polyfit(x, [p.loss for p in pts[i - 1:i + 2]], 2)
        if a > 0:
            v = -b / (2 * a)
            return WidthOptimum(pts[i].width, float(math.exp(v)), float(c - b * b / (4 * a)),
                                "quadratic", False)
    return WidthOptimum(pts[i].width, pts[i].lr, pts[i].loss, "grid", edge)


def grid_ratio(points: Iterable[TransferPoint]) -> float:
    """The LR grid's step: the median ratio of neighbouring distinct LRs."""
    lrs = sorted({round(p.lr, 12) for p in points})
    if len(lrs) < 2:
        return 2.0
    return float(np.median([b / a for a, b in zip(lrs, lrs[1:], strict=False)]))


def analyse(points: Sequence[TransferPoint]) -> dict:
    """parametrisation -> its best LR per width and the drift from the smallest width to
    the largest, in grid steps (log of the LR ratio in units of the grid's step)."""
    step = grid_ratio(points)
    by: dict[str, dict[int, list[TransferPoint]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        by[p.parametrization][p.width].append(p)
    out = {}
    for kind, widths in sorted(by.items()):
        optima = [best_lr(widths[w]) for w in sorted(widths) if len(widths[w]) >= 1]
        first, last = optima[0], optima[-1]
        out[kind] = {"optima": [asdict(o) for o in optima],
                     "drift_steps": math.log(last.lr / first.lr) / math.log(step),
                     "lr_ratio": last.lr / first.lr, "grid_step": step}
    return out


def table(report: dict) -> str:
    lines = []
    for kind, r in report.items():
        lines.append(f"{kind}: best LR per width (quadratic in log lr around the grid's best)")
        lines.append(f"  {'width':>6} {'best lr':>10} {'loss':>8}  how")
        for o in r["optima"]:
            note = o["how"] + (" (grid edge)" if o["edge"] else "")
            lines.append(f"  {o['width']:>6} {o['lr']:>10.3g} {o['loss']:>8.4f}  {note}")
        lines.append(f"  drift {r['optima'][0]['width']} -> {r['optima'][-1]['width']}: x"
                     f"{r['lr_ratio']:.3g} = {r['drift_steps']:+.2f} grid steps "
                     f"(step x{r['grid_step']:.3g})")
    return "\n".join(lines)


def plot(points: Sequence[TransferPoint], report: dict, path: Path) -> Path:
    """Loss against LR, one curve per width, one panel per parametrisation; the fitted
    optimum of each width marked."""
    from pretrain.analysis.scaling_plot import new_figure, write_png

    kinds = list(report)
    fig = new_figure((5.5 * len(kinds), 4.5), dpi=110)
    for j, kind in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), j + 1)
        for o in report[kind]["optima"]:
            pts = sorted((p for p in points if p.parametrization == kind
                          and p.width == o["width"]), key=lambda p: p.lr)
            line, = ax.plot([p.lr for p in pts], [p.loss for p in pts], marker="o",
                            label=f"width {o['width']}: best {o['lr']:.2g}")
            ax.plot([o["lr"]], [o["loss"]], marker="*", markersize=12, color=line.get_color())
        ax.set(xscale="log", xlabel="peak learning rate", ylabel="final validation loss",
               title=f"{kind}: optimum moves {report[kind]['drift_steps']:+.2f} grid steps")
        ax.legend(fontsize=7)
    return write_png(fig, path)


def transfer_report(dirs: Sequence[Path], out: Path | None, plots: bool = True) -> int:
    """``tools/scaling_law.py --transfer DIR...``: print the table, write transfer.json and
    transfer.png into ``out`` (default: ``<first folder>/transfer``)."""
    import json

    points = [p for d in dirs for p in collect_transfer(d)]
    if not points:
        print("no finished runs with a recorded width and parametrization under "
              + ", ".join(map(str, dirs)))
        return 1
    report = analyse(points)
    print(table(report))
    out = Path(out) if out else Path(dirs[0]) / "transfer"
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(
        {"report": report, "runs": [asdict(p) for p in points]}, indent=1))
    if plots:
        print(f"plot: {plot(points, report, out / 'transfer.png')}")
    print(f"fit: {out / 'transfer.json'}")
    return 0
