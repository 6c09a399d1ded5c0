"""Downstream tasks while the run trains: HellaSwag, ARC, PIQA and friends scored by the
model's log-likelihood of each choice (data/task_scoring.py: lm-eval's ranked
classification), from task data on this machine (data/tasks.py), at evaluation points.

The hook adds ``task/<name>/acc``, ``task/<name>/acc_norm`` and ``task/<name>/bpb`` to the
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
import time
from typing import Any

import torch

from pretrain.config.schema import EvalConfig
from pretrain.data import task_scoring
from pretrain.data.task_scoring import TaskSet
from pretrain.data.tasks import describe_source
from pretrain.train.hooks import Hook

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


class TaskEvaluation(Hook):
    """Scores ``eval.tasks`` at the evaluation points ``eval.task_interval`` picks and at
    the last step (see the module's docstring)."""

    name = "downstream"

    def __init__(self, cfg: EvalConfig):
        self.cfg = cfg
        self.tasks: TaskSet | None = None
        self.last: dict[str, float] = {}

    def start(self, trainer: Any) -> None:
        """Load and encode the tasks before the first step (a missing task stops the run
        here, naming what provides it)."""
        tokenizer = trainer.train_data.path / "tokenizer.json"
        t0 = time.perf_counter()
        self.tasks = TaskSet(self.cfg, tokenizer, trainer.cfg.model.seq_len)
        interval = self.cfg.task_interval or trainer.cfg.train.eval_interval
        tokens = self.tasks.tokens(self._batch_size(trainer), trainer.layout.tp)
        # forward only: 2 N FLOPs a token, against a training step's 6 N a token
        cost = tokens / (3 * trainer.budget.global_batch_tokens)
        log.info("downstream tasks from %s: %s; scored every %d steps and at the last: "
                 "%s tokens forward each time, the FLOPs of %.2f training steps (%.1f%% of "
                 "the %d steps between scorings; %.1f s to load)",
                 describe_source(self.cfg.tasks_dir), self.tasks.describe(), interval,
                 f"{tokens:,}", cost, 100 * cost / interval, interval,
                 time.perf_counter() - t0)

    def _batch_size(self, trainer: Any) -> int:
        return self.cfg.batch_size or trainer.cfg.parallel.micro_batch_size

    def due(self, trainer: Any) -> bool:
        interval = self.cfg.task_interval
        return not interval or trainer.step % interval == 0 or \
            trainer.step == trainer.budget.steps

    def evaluate(self, trainer: Any, metrics: dict) -> None:
        if self.tasks is None or not self.due(trainer):
            return
        t0 = time.perf_counter()
        self.last = self.score(trainer)
        metrics.update(self.last)
        metrics["task_eval_s"] = time.perf_counter() - t0

    def score(self, trainer: Any) -> dict[str, float]:
        """This step's metrics; every rank calls it (the batches are split over DP)."""
        module, layout = trainer.module, trainer.layout
        return score(self.tasks, module.token_logprobs, self._batch_size(trainer),
                     rank=trainer.place.dp_rank, world=layout.dp, pad_multiple=layout.tp,
                     device=trainer.device, reduce=module.sum_over_dp)

    def finish(self, trainer: Any, result: dict) -> None:
        result.update(self.last)


def build(trainer: Any) -> TaskEvaluation | None:
    """The hook when ``eval.tasks`` names any (the registry's entry)."""
    return TaskEvaluation(trainer.cfg.eval) if trainer.cfg.eval.tasks else None
