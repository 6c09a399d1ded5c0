"""Coordinate check of the parametrisations (muP's test that activations do not grow with
width): a tiny GPT at several widths, a few AdamW steps each, per-layer activation RMS.

    pretrain-coord-check                          # widths 64..1024, sp mup completep
    pretrain-coord-check --widths 64 128 256 --steps 3 --out runs/coord-check

Writes ``coord_check.json`` (RMS per parametrisation, width, layer and step; the slopes)
and ``coord_check.png`` under ``--out``, and prints each layer's largest log-log slope of
RMS against width. muP and CompleteP pass when every slope is below 0.1; under sp some
layer's is well above (0.3 is the bar the tests use). The code is
src/pretrain/analysis/coord_check.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pretrain.analysis.coord_check import (
    DEFAULT_WIDTHS,
    PARAMETRIZATIONS,
    coord_check,
    plot,
    summary,
)
from pretrain.errors import cli

PASS_SLOPE = 0.1  # muP/CompleteP: every layer below this


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pretrain-coord-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=list(DEFAULT_WIDTHS),
                   help="d_model values; the smallest is the base width (4 heads each)")
    p.add_argument("--parametrizations", nargs="+", default=list(PARAMETRIZATIONS),
                   choices=PARAMETRIZATIONS)
    p.add_argument("--steps", type=int, default=5, help="AdamW steps per width")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW's (base) LR")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--base-depth", type=int, default=1,
                   help="completep's base depth (its residual branches are x base/n_layer)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/coord-check"))
    return p.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if len(a.widths) < 2:
        print("pretrain-coord-check: give at least two --widths", file=sys.stderr)
        return 2
    result = coord_check(a.parametrizations, a.widths, a.steps, a.lr, a.batch, a.seq_len,
                         a.n_layer, a.base_depth, a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "coord_check.json").write_text(json.dumps(result, indent=1))
    png = plot(result, a.out / "coord_check.png")
    print(summary(result))
    for kind, r in result["parametrizations"].items():
        verdict = "flat" if r["max_slope"] < PASS_SLOPE else "grows"
        print(f"{kind}: largest slope {r['max_slope']:+.3f} ({r['worst_layer']}): {verdict}")
    print(f"wrote {a.out / 'coord_check.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
