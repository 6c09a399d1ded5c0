"""Downstream task scores at evaluation points (train/downstream.py: the tasks, the scoring;
``eval.tasks`` names them, none by default), on the loop's seam: ``task/<name>/acc``,
``acc_norm`` and ``bpb`` recorded at each scoring and their last values in result.json."""

from __future__ import annotations

import logging
import time

from pretrain.config.schema import EvalConfig
from pretrain.data.task_scoring import TaskSet
from pretrain.data.tasks import describe_source
from pretrain.train.downstream import score
from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")


class TaskEvaluation(Hook):
    """Scores ``eval.tasks`` at the evaluation points ``eval.task_interval`` picks and at
    the last step (see train/downstream.py's docstring)."""

    name = "downstream"

    def __init__(self, cfg: EvalConfig):
        self.cfg = cfg
        self.tasks: TaskSet | None = None
        self.last: dict[str, float] = {}

    def start(self, ctx: LoopContext) -> None:
        """Load and encode the tasks before the first step (a missing task stops the run
        here, naming what provides it)."""
        t0 = time.perf_counter()
        self.tasks = TaskSet(self.cfg, ctx.tokenizer, ctx.cfg.model.seq_len)
        interval = self.cfg.task_interval or ctx.cfg.train.eval_interval
        tokens = self.tasks.tokens(self._batch_size(ctx), ctx.layout.tp)
        # forward only: 2 N FLOPs a token, against a training step's 6 N a token
        cost = tokens / (3 * ctx.batch_tokens)
        log.info("downstream tasks from %s: %s; scored every %d steps and at the last: "
                 "%s tokens forward each time, the FLOPs of %.2f training steps (%.1f%% of "
                 "the %d steps between scorings; %.1f s to load)",
                 describe_source(self.cfg.tasks_dir), self.tasks.describe(), interval,
                 f"{tokens:,}", cost, 100 * cost / interval, interval,
                 time.perf_counter() - t0)

    def _batch_size(self, ctx: LoopContext) -> int:
        return self.cfg.batch_size or ctx.cfg.parallel.micro_batch_size

    def due(self, ctx: LoopContext) -> bool:
        interval = self.cfg.task_interval
        return not interval or ctx.step % interval == 0 or ctx.step == ctx.total_steps

    def evaluate(self, ctx: LoopContext) -> None:
        if self.tasks is None or not self.due(ctx):
            return
        t0 = time.perf_counter()
        self.last = self.score(ctx)
        for key, value in self.last.items():
            ctx.record(key, value)
        ctx.record("task_eval_s", time.perf_counter() - t0)

    def score(self, ctx: LoopContext) -> dict[str, float]:
        """This step's metrics; every rank calls it (the batches are split over DP)."""
        module, layout = ctx.module, ctx.layout
        return score(self.tasks, module.token_logprobs, self._batch_size(ctx),
                     rank=ctx.dp_rank, world=layout.dp, pad_multiple=layout.tp,
                     device=ctx.device, reduce=module.sum_over_dp)

    def finish(self, ctx: LoopContext) -> None:
        for key, value in self.last.items():
            ctx.record(key, value)


@register(order=60)
def build(ctx: LoopContext) -> TaskEvaluation | None:
    """The hook when ``eval.tasks`` names any."""
    return TaskEvaluation(ctx.cfg.eval) if ctx.cfg.eval.tasks else None
