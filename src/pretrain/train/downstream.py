"""Downstream tasks while the run trains: HellaSwag, ARC, PIQA and friends scored by the
model's log-likelihood of each choice (data/task_scoring.py: lm-eval's ranked
classification), from task data on this machine (data/tasks.py), at evaluation points.

The hook (services/tasks.py) adds ``task/<name>/acc``, ``task/<name>/acc_norm`` and
``task/<name>/bpb`` to the
evaluation's metrics (log line, metrics.jsonl, wandb) and the last values to result.json
(flat numbers, so a sweep's fit can read a task's bpb as it reads val_loss).

The forward is the train module's (``token_logprobs``: the model as the validation loss
runs it, in the run's compute dtype). Batches are spread over the DP ranks and their
log-likelihoods summed over them (``sum_over_dp``), so every layout that holds whole
models or TP shards gives the numbers one process gives; pipeline layouts are refused by
the config check (decision/checks.py) until the schedule returns per-token losses.
"""

from __future__ import annotations

import logging

import torch

from pretrain.data import task_scoring
from pretrain.data.task_scoring import TaskSet

log = logging.getLogger("pretrain")


def score(tasks: TaskSet, logprobs, batch_size: int, *, rank: int = 0, world: int = 1,
          pad_multiple: int = 1, device: torch.device | str = "cpu",
          reduce=lambda t: t) -> dict[str, float]:
    """Every task's metrics as flat ``task/<name>/<metric>`` keys; ``reduce`` sums a
    rank's log-likelihoods over the ranks that split the batches."""
    out: dict[str, float] = {}
    for task, reqs in tasks.requests.items():
        lls = task_scoring.loglikelihoods(reqs, logprobs, batch_size, rank=rank, world=world,
                                          pad_multiple=pad_multiple, device=device)
        lls = reduce(lls.to(device)).double().cpu()
        for key, value in task_scoring.metrics(tasks.examples[task], lls.tolist()).items():
            out[f"task/{task}/{key}"] = value
    return out
