"""The one training loop every recipe runs, on one process or many.

A linear story: resolve the run (decision/resolve.py: ``auto`` decided, plan printed), join
the process group, read the prepared data, build the train module (train_module.py: model,
optimizer, schedule, loss scaler, step strategy), resume or start, then loop: batch -> step
-> log -> evaluate -> stop or save. Setup's steps and close are lifecycle.py's. Beside the
loop: batches.py (each step's batch: a batch ramp's), evaluation.py (every source's
validation loss), metrics.py (loss window, throughput, MFU, sinks), checkpoint/ (saving,
resume), preemption.py (stop, save, requeue), and the services on the hook seam (hooks.py:
each sees a ``LoopContext``, never the trainer; the services/ package holds them). The loop
asks nothing about the layout and imports nothing from ``parallel/``
(tests/test_architecture.py). Rank 0 alone logs."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import torch

from pretrain.config.schema import Config
from pretrain.data.run_data import require_prepared
from pretrain.decision.checks import device_problems
from pretrain.decision.resolve import announce, dry_run, resolve_run
from pretrain.train.batches import Batches
from pretrain.train.hang import CollectiveWatch
from pretrain.train.hooks import LoopContext, StepTiming, call_hooks
from pretrain.train.lifecycle import Lifecycle
from pretrain.train.metrics import LossWindow, Throughput, memory_metrics
from pretrain.train.preemption import StopRequest, already_finished, requeue_exit
from pretrain.train.services import build_hooks
from pretrain.train.train_module import join, max_over_ranks

log = logging.getLogger("pretrain")


class Trainer(Lifecycle):
    """Runs one recipe (``setup``, ``fit``, ``close``: what comes before and after the loop is
    lifecycle.py's). Also a DCP ``Stateful``: its progress (step, data position, LR
    schedule, loss scale, RNG) is saved and restored with the model and optimizer."""

    def __init__(self, cfg: Config, run_dir: Path):
        # First: a SIGTERM during start-up (minutes on a cluster) is a stop request, not a kill
        self.stop_request = StopRequest(cfg.train.time_limit_minutes)
        self.run_dir = Path(run_dir)
        self.run = run = resolve_run(cfg)
        # what the run reads (typed) and what it reports (plan.json)
        self.cfg, self.decision, self.budget = run.cfg, run.decision, run.budget
        self.plan = run.plan
        self.device, self.policy, self.layout = run.device, run.policy, run.layout
        device_problems(cfg, self.device)  # a key this device cannot serve, before any work
        self.world_size = run.world_size
        self.step = self.samples_seen = 0
        self.batches = Batches.of(run)  # each step's batch (a ramp's) and the budget's end
        self.first_val_loss: float | None = None
        self.last_val_loss: float | None = None
        self.exit_code = 0
        self.prefetch = self.lock = None
        self.hooks: list = []  # services.build_hooks, once the train module exists
        self.ctx: LoopContext | None = None  # what the hooks see of the run
        self.timing = StepTiming()  # this step's host clock (hooks.StepTiming)
        self.watch = CollectiveWatch(cfg.comm)  # collective timeouts (hang.py)

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first step, in order: join the process group, say what
        will run, read the data, build the train module and the services, then continue
        from a checkpoint (or start afresh) and open the metrics."""
        if self.world_size > 1:
            require_prepared(self.cfg)  # before the process group: every rank fails at once
        place = join(self.layout, self.device, self.policy, self.world_size, self.cfg.comm)
        self.place, self.device, self.rank0 = place, place.device, place.rank0
        self.watch.start()
        if not self.rank0:  # one voice: the other ranks report only warnings and errors
            log.setLevel(logging.WARNING)
        if self.device.type == "cuda":
            # TF32 tensor cores for fp32 matmuls (10-bit mantissa products, fp32 accumulate),
            # as torchtitan and Megatron-LM do; train.tf32=false keeps full fp32.
            torch.set_float32_matmul_precision("high" if self.cfg.train.tf32 else "highest")
        announce(self.run, self.device)
        self._load_data()
        self._build_training()
        self.ctx = self._context()
        self.hooks = build_hooks(self.ctx)
        self._start_run()

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"step": self.step, "samples_seen": self.samples_seen,
                "first_val_loss": self.first_val_loss, **self.module.state_dict(),
                "rng": torch.get_rng_state(), **self.batches.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.first_val_loss = state.get("first_val_loss")
        self.module.load_state_dict(state)
        torch.set_rng_state(state["rng"])
        self.batches.load_state_dict(state)

    # the budget is spent (batches.Batches.finished); tokens trained on so far
    finished = property(lambda self: self.batches.finished(self.step, self.samples_seen))
    tokens = property(lambda self: self.samples_seen * self.cfg.model.seq_len)

    # -- steps ---------------------------------------------------------------------------

    def _local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's slice of the global batch: samples are read by global index, so
        the union over ranks is exactly the batch one process would read."""
        n = self.layout.local_batch_size  # read ahead:
        x, y = self.prefetch.get(self.batches.key(self.samples_seen, self.place.dp_rank, n))
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (mean loss, grad norm), both global (the same on every
        rank): an all-reduce and a host sync each step, for tests and tools that want every
        step's loss. fit() calls train_step_local and reduces on logging steps only."""
        loss, norm = self.train_step_local()
        self._check_nonfinite()
        return self.module.global_loss(loss).item(), norm.item()

    def train_step_local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the global batch (``TrainModule.step``); returns (this
        rank's share of the loss, not reduced; the global grad norm), device tensors; the
        hooks' ``before_step`` before its forward (the noise scale arms its measurement there)."""
        batch = self.batches.next(self.samples_seen)
        # the batch (its wait timed: hooks.StepTiming), then the hooks' before_step
        x, y = self.timing.fetch(self._local_batch, then=lambda: self._call_hooks("before_step"))
        loss, grad_norm, _ = self.module.step(x, y, self.step + 1,
                                              samples_after=self.samples_seen + batch)
        self.batches.took(batch)
        self.samples_seen += batch
        self.step += 1
        return loss, grad_norm

    def _check_nonfinite(self) -> None:
        self.module.check_nonfinite(self.step)

    def logging_step(self, step: int) -> bool:
        """Whether fit() logs after optimizer step ``step`` (1-based): hooks measure on
        those steps only, whose host syncs and collectives are there anyway."""
        return (
            step == 1
            or self.batches.is_last(step, self.step, self.samples_seen)
            or step % self.cfg.logging.log_interval == 0
        )

    def evaluate(self) -> float | None:
        """The run's validation loss (evaluation.mixture_mean over its sources; None without
        a validation split): every rank."""
        return self.validation.evaluate()["val_loss"] if self.validation is not None else None

    # -- loop ----------------------------------------------------------------------------

    def fit(self) -> dict:
        """The run: the hooks' start, evaluate the starting model, then step after step:
        train, log (on logging steps), evaluate (when due), stop on a request or save (when
        due), until the budget is spent; then the final checkpoint and the result."""
        if self.finished:  # resumed from the final checkpoint
            return self._exit(already_finished(self.run_dir, self.step, self.budget.steps))
        stopped = self.stop_request.at_start(self.device, self.step)  # during start-up
        if stopped is not None:
            return self._exit_stopped(stopped)
        if self.validation is not None and self.rank0:
            self.validation.describe()
        with self.watch.watching(lambda: self.step + 1):  # a collective timed out: exit 76
            try:
                self._call_hooks("start")
                self._evaluate_at_start()
                window, clock = LossWindow(self.device), Throughput()
                stopped = None
                while not self.finished and stopped is None:
                    stopped = self._train_one(window, clock)
                    self.watch.after_first_step()
                if stopped is not None:
                    return self._exit_stopped(stopped)
                return self._finish(window.final)
            finally:
                self._close_hooks()

    def _call_hooks(self, point: str, sink: dict | None = None) -> None:
        call_hooks(self.hooks, self.ctx, point, sink)  # in services.build_hooks's order

    def _close_hooks(self) -> None:
        """Once, at the end of fit or in close (whichever comes first)."""
        while self.hooks:
            self.hooks.pop(0).close()

    def _train_one(self, window: LossWindow, clock: Throughput) -> str | None:
        """One step of fit's loop: train, log (on logging steps; the hooks' step_end in
        between), evaluate (when due), stop or save."""
        loss, grad_norm = self.train_step_local()
        window.add(loss, counted=torch.isfinite(grad_norm))
        clock.steps, clock.tokens = clock.steps + 1, clock.tokens + self.batches.last_tokens
        self.metrics.advance()
        metrics = (self._step_metrics(window, grad_norm, clock)
                   if self.logging_step(self.step) else None)
        self._call_hooks("step_end", metrics)
        if metrics is not None:
            self.batches.observe(self.step, self.samples_seen, metrics.get("noise_scale"))
            self.metrics.log(metrics)
            clock.restart()
        if self.step % self.cfg.train.eval_interval == 0 or self.finished:
            with clock.paused():  # eval time is not training throughput
                self._evaluate_and_log()
        if self.finished:  # the end of fit saves
            return None
        return self.stop.stop_or_save(self.step, self._check_nonfinite, self.save_checkpoint)

    def _evaluate_at_start(self) -> None:
        """The untrained model's validation loss, logged at step 0; a resumed run measured
        it before it stopped (its checkpoint holds it)."""
        if self.step == 0:
            self._evaluate_and_log()
            self.first_val_loss = self.last_val_loss
        self.last_val_loss = self.first_val_loss

    def _step_metrics(self, window: LossWindow, grad_norm: torch.Tensor,
                      clock: Throughput) -> dict:
        """A logging step's line (the hooks add to it): the mean loss since the last one,
        throughput, MFU, memory (the fullest rank's)."""
        tps = clock.rate(self.budget.global_batch_tokens)
        self._check_nonfinite()
        loss = window.reduce(self.module.global_loss)
        return {
            "step": self.step, "loss": loss, "lr": self.module.lr,
            "grad_norm": grad_norm.item(), "tokens_per_s": tps,
            "mfu": self.peak.mfu(tps * self.budget.flops_per_token),
            **memory_metrics(self.device, max_over_ranks),
            "tokens": self.tokens, **self.batches.line(),
            "loss_scale": self.module.loss_scale, **self.module.step_counts(logging=True),
        }

    def _evaluate_and_log(self) -> None:
        """The validation losses and what the hooks measure at an evaluation point, logged."""
        val = self.validation.evaluate() if self.validation is not None else {}
        self.last_val_loss = val.pop("val_loss", None)
        metrics = {"step": self.step, "val_loss": self.last_val_loss,
                   "tokens": self.tokens, **val}
        self._call_hooks("evaluate", metrics)
        metrics = {k: v for k, v in metrics.items() if v is not None}
        if len(metrics) > 2:  # more than the step and the tokens
            self.metrics.log(metrics)

    def save_checkpoint(self, block: bool = False) -> None:
        self.checkpoints.save(self, block=block)

    def _exit_stopped(self, stopped: str) -> dict:
        """A run stopped early, to be requeued (preemption.requeue_exit)."""
        self.exit_code = requeue_exit(self.run_dir, self.step, stopped, self.rank0)
        return self._exit({"steps": self.step, "stopped": stopped})

    def _exit(self, result: dict) -> dict:
        self.ckpt.close()
        self.metrics.close()
        return result

    def _finish(self, final_loss: float) -> dict:
        """The budget is spent: the final checkpoint, the result (the hooks add to it), and
        result.json."""
        self._check_nonfinite()
        if self.cfg.checkpoint.enabled:
            self.save_checkpoint(block=True)
        self.ckpt.close()
        result = {"steps": self.step, "final_loss": final_loss,
                  "first_val_loss": self.first_val_loss, "final_val_loss": self.last_val_loss,
                  "tokens": self.tokens, **self.module.step_counts(),
                  **self.batches.result(),
                  "val_batches": self.validation.batch_count() if self.validation else None,
                  "final_lr": self.module.lr, **({"branch": self.branch} if self.branch else {}),
                  **(self.validation.result() if self.validation else {})}
        self._call_hooks("finish", result)
        if self.rank0:
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        self.metrics.close()
        return result


def run(cfg: Config, run_dir: Path, trainer_class: type[Trainer] = Trainer) -> dict | None:
    """Entry point shared by train.py and the tools: dry run or train (one process, or one
    of the processes torchrun started). ``trainer_class``: a runner that wraps the loop
    (fault_tolerant.ReplicaGroupTrainer)."""
    if cfg.dry_run:
        return dry_run(cfg)
    trainer = trainer_class(cfg, run_dir)
    try:
        trainer.setup()
        if trainer.rank0:
            (Path(run_dir) / "plan.json").write_text(json.dumps(trainer.plan, indent=2))
        result = trainer.fit()
        result["exit_code"] = trainer.exit_code
        return result
    finally:
        trainer.close()
        # The trainer's reference cycles hold the DTensors, meshes and process groups: free
        # them now, while the interpreter can still run their gloo threads' last decrefs,
        # not at its shutdown (where one aborted a two-process run after it had finished).
        del trainer
        gc.collect()
