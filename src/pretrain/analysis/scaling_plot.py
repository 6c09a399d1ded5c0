"""PNG plots of a scaling-law fit: loss against compute, and iso-FLOP curves.

Kept apart from the fits so that fitting needs scipy only and plotting matplotlib only
(both in the ``analysis`` extra). Each plot is its own ``Figure`` drawn on an Agg canvas:
files, never a window, and no pyplot state (the backend of a program that imports this
module stays its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import (
    ChinchillaLaw,
    FitReport,
    compute_frontier,
    isoflop_groups,
    isoflop_minimum,
)


def new_figure(figsize: tuple[float, float] = (7.5, 5), dpi: int = 120):
    """A figure of its own, outside pyplot (no global backend, nothing left to close)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def write_png(fig, path: Path | str) -> Path:
    """Lay ``fig`` out and write it to ``path`` (its directory made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _figure():
    fig = new_figure()
    return fig, fig.add_subplot()


def plot_loss_vs_compute(points: Sequence[RunPoint], compute: FitReport | None,
                         chinchilla: FitReport | None, target_flops: float | None,
                         path: Path) -> Path:
    """Runs, the L(C) fit with its bootstrap 95% band out to the target, the predicted
    loss there, and (when fitted) L(N, D) along its compute-optimal frontier."""
    fig, ax = _figure()
    c = np.array([p.flops for p in points])
    hi = max(c.max(), target_flops or 0) * 2
    grid = np.logspace(np.log10(c.min() / 2), np.log10(hi), 200)
    frontier = compute_frontier(points)
    if len(frontier) < len(points):
        ax.scatter(c, [p.loss for p in points], s=18, color="0.6", zorder=2,
                   label=f"all runs ({len(points)})")
    ax.scatter([p.flops for p in frontier], [p.loss for p in frontier], s=28, color="black",
               zorder=3, label=f"best run per budget ({len(frontier)}), fitted")
    if compute is not None:
        law = compute.law
        ax.plot(grid, law.predict(grid), color="C0",
                label=f"L(C) = {law.a:.3g} C^{law.b:.3f} + {law.c:.3f}")
        if len(compute.samples) >= 10:
            band = np.array([s.predict(grid) for s in compute.samples])
            lo, up = np.percentile(band, [2.5, 97.5], axis=0)
            ax.fill_between(grid, lo, up, color="C0", alpha=0.15, label="bootstrap 95%")
        ax.axhline(law.c, color="C0", ls=":", lw=1, label=f"irreducible c = {law.c:.3f}")
        if target_flops:
            est = compute.predictions["loss"]
            # The bootstrap interval is drawn as it is, apart from the point: a percentile
            # interval of resampled fits need not contain the full-data fit (skewed or
            # collapsed resamples), so it is not an error bar around the point.
            if np.isfinite(est.low) and np.isfinite(est.high):
                ax.plot([target_flops, target_flops], [est.low, est.high], color="C3", lw=2,
                        solid_capstyle="butt", zorder=4,
                        label=f"bootstrap 95%: [{est.low:.3f}, {est.high:.3f}]")
            ax.plot([target_flops], [est.value], marker="*", ms=14, ls="none", color="C3",
                    zorder=5, label=f"prediction at C={target_flops:.3g}: {est.value:.3f}")
    if chinchilla is not None:
        assert isinstance(chinchilla.law, ChinchillaLaw)
        ax.plot(grid, chinchilla.law.optimal_loss(grid), color="C2", ls="--",
                label="L(N, D) at compute-optimal N, D")
    losses = [p.loss for p in points]
    if compute is not None and target_flops:
        losses.append(compute.predictions["loss"].value)
    span = max(losses) - min(losses) or 1.0
    ax.set_ylim(min(losses) - 0.4 * span, max(losses) + 0.2 * span)  # a wild band: clipped
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs, 6ND)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("Loss vs compute")
    return _save(fig, ax, path)


def _save(fig, ax, path: Path) -> Path:
    """The finishing touches every plot shares: grid, legend, layout, PNG."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return write_png(fig, path)


def plot_isoflop(points: Sequence[RunPoint], chinchilla: FitReport | None, path: Path) -> Path:
    """Loss against N, one curve per compute budget (runs within 10% of the same C), with
    the vertex of a parabola in log N where a budget has 3+ runs (Hoffmann et al.'s
    approach 2), and the L(N, D) fit's prediction for each budget when there is one."""
    from matplotlib import colormaps

    fig, ax = _figure()
    groups = isoflop_groups(points)
    cmap = colormaps["viridis"]
    n_all = np.array([p.n_params for p in points])
    n_grid = np.logspace(np.log10(n_all.min() / 2), np.log10(n_all.max() * 2), 200)
    singles = [g[0] for g in groups if len(g) == 1]
    for i, group in enumerate(groups):
        color = cmap(i / max(len(groups) - 1, 1))
        budget = float(np.exp(np.mean(np.log([p.flops for p in group]))))
        if len(group) > 1:
            ax.plot([p.n_params for p in group], [p.loss for p in group], "o-", color=color,
                    label=f"C = {budget:.3g}")
            vertex = isoflop_minimum(group)
            if vertex is not None:
                ax.plot(*vertex, marker="x", ms=10, mew=2, color=color)
        if chinchilla is not None and len(group) > 1:
            ns = n_grid[(n_grid > group[0].n_params / 3) & (n_grid < group[-1].n_params * 3)]
            ax.plot(ns, chinchilla.law.predict(ns, budget / (6 * ns)), ls="--", lw=1,
                    color=color)
    if singles:
        sc = ax.scatter([p.n_params for p in singles], [p.loss for p in singles],
                        c=np.log10([p.flops for p in singles]), cmap="plasma", zorder=3,
                        label="one run per budget (a ladder)")
        fig.colorbar(sc, ax=ax, label="log10 C")
    if chinchilla is not None:
        ax.plot([], [], "k--", lw=1, label="L(N, D) fit at each budget")
    if any(len(g) >= 3 for g in groups):
        ax.plot([], [], "kx", ms=8, label="parabola minimum (approach 2)")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("final validation loss (nats/token)")
    title = "Iso-FLOP curves"
    if all(len(g) == 1 for g in groups):
        title += " (no budget has 2+ runs: add an iso-FLOP sweep, budget=flops)"
    ax.set_title(title, fontsize=10)
    return _save(fig, ax, path)
