"""The loss curves of tools/measure_fault_schedule.py's runs (issue 71): the loss against the
step and against the wall time, each run's ``--out`` file a line, its kills marked.

    python tools/plot_fault_schedule.py docs/reliability-loss.png \\
        restart-full.json torchft-full.json restart-nofault.json torchft-nofault-4.json

A line is the mean of each 10 steps' logged loss (the groups' mean for torchft); a faulty
run's kills are dotted lines on the wall-time panel, in its colour.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WINDOW = 10


def curve(run: dict) -> tuple[list[int], list[float], list[float]]:
    """(step, wall seconds, loss) at the end of each WINDOW steps, the loss their mean."""
    ps = sorted((int(s), v) for s, v in run["per_step"].items())
    out: tuple[list[int], list[float], list[float]] = ([], [], [])
    for i in range(WINDOW, len(ps) + 1, WINDOW):
        chunk = ps[i - WINDOW:i]
        out[0].append(chunk[-1][0])
        out[1].append(chunk[-1][1][2])
        out[2].append(sum(v[1] for _, v in chunk) / WINDOW)
    return out


def label(path: Path, run: dict) -> str:
    kind = "torchft" if run["path"] == "torchft" else "restart (DDP)"
    faults = f"{len(run['kills'])} kills" if run["faults"] else "no faults"
    return f"{kind}, {faults}: {run['steps_kept']} steps in {run['wall_s']:.0f} s ({path.stem})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("png", type=Path)
    ap.add_argument("runs", type=Path, nargs="+", help="--out files of measure_fault_schedule")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, path in enumerate(args.runs):
        run = json.loads(path.read_text())
        steps, wall, loss = curve(run)
        color = f"C{i}"
        style = "-" if run["faults"] else "--"
        by_step.plot(steps, loss, style, color=color, label=label(path, run))
        by_time.plot(wall, loss, style, color=color)
        for t, _ in run["kills"]:
            by_time.axvline(t, color=color, linestyle=":", linewidth=0.8)
    by_step.set(xlabel="step", ylabel=f"training loss (mean of {WINDOW} steps)")
    by_time.set(xlabel="wall seconds from the first step")
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
