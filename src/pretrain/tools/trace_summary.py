"""Summarise a folder of torch.profiler traces (a run's ``profile/``, every rank's):

    pretrain-trace-summary runs/NAME/profile
    python tools/trace_summary.py runs/NAME/profile --top 8

One line per trace (rank and window): its step time, the compute, communication and idle
shares, the top ops by self time (the run's log line says the same, hardware/profiler_trace.py);
then one line per collective over the ranks: its calls and time on each rank, and the
slowest rank, the one the others waited for (it spends the least time inside the
collective because it arrives last), and the rank that waited longest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.errors import UserError, cli
from pretrain.hardware.profiler_trace import collective_table, summarize_folder


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pretrain-trace-summary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a run's profile/ folder (or any folder of "
                   "Chrome trace .json files)")
    p.add_argument("--top", type=int, default=5, help="ops per line (by self time)")
    return p.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.folder.is_dir():
        raise UserError(f"{args.folder} is not a folder: give a run's profile/ folder "
                        "(written when profile.enable=true)")
    summaries = summarize_folder(args.folder)
    if not summaries:
        raise UserError(f"no torch.profiler trace (.json with traceEvents) under "
                        f"{args.folder}: run with profile.enable=true first")
    for s in summaries:
        print(s.line(args.top))
    ranks = {s.rank for s in summaries}
    print(f"collectives over {len(ranks)} rank(s):")
    for line in collective_table(summaries) or ["none in these traces"]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
