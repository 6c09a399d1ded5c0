"""Draw a run's curves from its metrics.jsonl (no wandb needed):

    pretrain-plot-run runs/NAME --out runs/NAME/run.png
    python tools/plot_run.py runs/A runs/B --out compare.png

Panels: training loss and validation loss (per source, for a mixture), learning rate,
gradient norm, tokens/s, MFU and memory; several runs are overlaid, one colour each.
The code is src/pretrain/analysis/run_plot.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.analysis.run_plot import plot
from pretrain.errors import cli


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pretrain-plot-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="run directories (runs/NAME)")
    p.add_argument("--out", type=Path, required=True, help="the figure, e.g. run.png")
    return p.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _, data = plot(args.runs, args.out)
    drawn = {t: sum(len(lines) for lines in runs.values()) for t, runs in data.items()}
    print(f"{args.out}: {len(args.runs)} run(s); lines per panel: "
          + ", ".join(f"{t} {n}" for t, n in drawn.items() if n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
