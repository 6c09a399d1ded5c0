"""The one training loop every recipe runs, on one process or many.

A linear story: resolve the run (resolve.py: ``auto`` decided, plan printed), join the process
group, check the data is prepared, build the train module (train_module.py: model, optimizer,
schedule, loss scaler and step strategy for this layout), resume or start, then loop: batch -> step
-> log -> evaluate -> stop or save. The services sit beside the loop, each in its own file:
evaluation.py (validation loss, sample), noise_scale.py (the probe), metrics.py (loss window,
throughput, MFU, sinks), checkpoint/ (saving, resume decisions), preemption.py (stop, save and
requeue policy). The loop asks nothing about the layout; it imports nothing from ``parallel/``
(tests/test_architecture.py). Rank 0 alone logs and writes files.
"""

from __future__ import annotations

import gc
import json
import logging
import math
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pretrain.budget.hparams import describe
from pretrain.checkpoint.manager import CheckpointManager, ModelOptimizer, on_rank0
from pretrain.checkpoint.resume import branch_record, load_weights, resume_path
from pretrain.config.schema import Config
from pretrain.data.epochs import check_epochs
from pretrain.data.loader import TokenWindows
from pretrain.data.prefetch import Prefetcher
from pretrain.data.prepare import DataError, data_dir, load_index, prepare, require_prepared
from pretrain.decision.resolve import dry_run, resolve_run
from pretrain.hardware.device import keep_freed_memory, peak_rss_bytes
from pretrain.planning.memory import checkpoint_bytes
from pretrain.train.evaluation import Evaluator, sample, source_validation
from pretrain.train.garbage import GarbageCollection
from pretrain.train.metrics import LossWindow, MetricsLogger, PeakFlops, Throughput, memory_metrics
from pretrain.train.noise_scale import NoiseScaleProbe, compare_batch
from pretrain.train.preemption import (
    EXIT_REQUEUE,
    STOPPED,
    StopRequest,
    StopSavePolicy,
    requeue_exit,
)
from pretrain.train.run_lock import RunLock
from pretrain.train.train_module import TrainModule, join, leave, max_over_ranks

log = logging.getLogger("pretrain")


class Trainer:
    """Runs one recipe. Also a DCP ``Stateful``: its progress (step, data position, LR
    schedule, loss scale, RNG) is saved and restored with the model and optimizer."""

    def __init__(self, cfg: Config, run_dir: Path):
        # First thing: a SIGTERM during start-up (minutes on a cluster) is a stop request
        # like any other, not a kill that saves nothing.
        self.stop_request = StopRequest(cfg.train.time_limit_minutes)
        self.run_dir = Path(run_dir)
        run = resolve_run(cfg)
        self.cfg, self.plan, self.budget = run.cfg, run.plan, run.budget
        self.device, self.policy, self.layout = run.device, run.policy, run.layout
        self.world_size = run.world_size
        self.step = self.samples_seen = 0
        self.first_val_loss: float | None = None
        self.last_val_loss: float | None = None
        self.exit_code = 0
        self.expert_loads: list[float] = []  # MoE: busiest expert over the mean, per log
        self.noise = NoiseScaleProbe(self.cfg, self.layout, self.budget.global_batch_tokens)
        self.prefetch = self.lock = None

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first step, in order: join the process group, say what
        will run, read the data, build the train module, then continue from a checkpoint
        (or start afresh) and open the metrics."""
        if self.world_size > 1:
            require_prepared(self.cfg)  # before the process group: every rank fails at once
        place = join(self.layout, self.device, self.policy, self.world_size)
        self.place, self.device, self.rank0 = place, place.device, place.rank0
        if not self.rank0:  # one voice: the other ranks report only warnings and errors
            log.setLevel(logging.WARNING)
        if self.device.type == "cuda":
            # TF32 tensor cores for fp32 matmuls (10-bit mantissa products, fp32 accumulate),
            # as torchtitan and Megatron-LM do; train.tf32=false keeps full fp32.
            torch.set_float32_matmul_precision("high" if self.cfg.train.tf32 else "highest")
        self._describe_plan()
        self._load_data()
        self._build_training()
        self._start_run()

    def _describe_plan(self) -> None:
        """The plan, the decisions taken for ``auto`` settings and the run in one line."""
        cfg, budget, plan = self.cfg, self.budget, self.plan
        log.info("plan: %s", json.dumps(plan))
        if "precision_auto" in plan:
            log.info("precision=auto -> %s", plan["precision_auto"])
        if "lr_warning" in plan:
            log.warning(plan["lr_warning"])
        if "hparam_rules" in plan:
            log.info(describe(plan["hparam_rules"]))
        log.info(self.noise.describe())
        log.info(
            "model %s: %s params (%s non-embedding%s%s), %s FLOPs/token | budget %s -> %s "
            "tokens in %d steps of %s tokens | precision %s | attention %s%s | layout %s | "
            "device %s",
            cfg.model.name, f"{budget.n_params:,}", f"{budget.n_params_non_embedding:,}",
            f"; {budget.n_params_active:,} active per token"
            if budget.n_params_active != budget.n_params else "",
            f"; + {budget.n_params_padding:,} in the vocabulary padded to "
            f"{cfg.model.pad_vocab_to}" if budget.n_params_padding else "",
            f"{budget.flops_per_token:,}", budget.rule, f"{budget.tokens:,}",
            budget.steps, f"{budget.global_batch_tokens:,}",
            " ".join(filter(None, [plan["precision"], plan.get("fp8"),
                                   "(auto)" if "precision_auto" in plan else None])),
            plan["attention"],
            f" | compile ({self.layout.compile_scope()})" if cfg.train.compile else "",
            self.layout.describe(), self.device,
        )

    def _load_data(self) -> None:
        """The training and (when prepared) validation windows."""
        cfg = self.cfg
        path = self._data()
        self.train_data = TokenWindows(path, "train", cfg.model.seq_len, seed=cfg.data.seed)
        self.val_data = (TokenWindows(path, "validation", cfg.model.seq_len, shuffle=False)
                         if "validation" in self.train_data.index["splits"] else None)
        # the next batches read on a thread while a step runs, pinned for async copies
        self.prefetch = Prefetcher(self.train_data, self.layout.local_batch_size,
                                   cfg.train.global_batch_size, pin=self.device.type == "cuda")
        if self.device.type == "cpu":
            keep_freed_memory()

    def _data(self) -> Path:
        """The prepared shards: one process prepares them on first use (auto_prepare); a
        multi-process run has checked before it started that they exist (preparing a real
        corpus is a job of its own, tools/prepare_data.py, not work for rank 0 while the
        other ranks wait on a collective's timeout)."""
        cfg = self.cfg
        path = data_dir(cfg.data)
        if self.world_size == 1 and cfg.data.auto_prepare:
            path = prepare(cfg.data)
        index = load_index(path)
        if index["max_token_id"] >= cfg.model.vocab_size:
            raise DataError(
                f"the data in {path} has token ids up to {index['max_token_id']} (tokenizer "
                f"vocabulary {index['vocab_size']}) but model.vocab_size={cfg.model.vocab_size}; "
                f"set model.vocab_size={index['vocab_size']} (or a larger padded size)"
            )
        self.plan.update(check_epochs(cfg.data, self.budget.tokens, index))
        log.info("data %s: %s training tokens, the budget is %.3g epochs of it", path,
                 f"{self.plan['data_tokens']:,}", self.plan["epochs"])
        return path

    def _build_training(self) -> None:
        """The train module, the evaluator and the MFU denominator."""
        cfg, layout = self.cfg, self.layout
        # Checkpoints are found before the model exists: a resumed run skips initialising.
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint, self.device,
                                      keep_steps=self.plan.get("branch_points", ()))
        self.ckpt.check_room(checkpoint_bytes(cfg))  # writable, room for one: before any work
        self.resume_from = resume_path(cfg, self.run_dir)
        self.branch = branch_record(cfg, self.run_dir, self.resume_from)  # a cooldown's source
        self.module = TrainModule(
            cfg, layout, self.place, self.policy, attention=self.plan["attention"],
            lr=self.plan["lr"], steps=self.budget.steps,
            batch_tokens=self.budget.global_batch_tokens,
            initialise=self.resume_from is None, small_seqs=self.noise.small_seqs,
            last_good=lambda: self.ckpt.latest() if cfg.checkpoint.enabled else None)
        self.evaluator = None if self.val_data is None else Evaluator(
            self.val_data, self.module, eval_batches=cfg.train.eval_batches,
            micro_batch_size=layout.micro_batch_size, dp=layout.dp,
            dp_rank=self.place.dp_rank, device=self.device)
        self.hooks = list(filter(None, [source_validation(self)]))  # until services.build_hooks
        self._log_startup_memory()
        self.peak = PeakFlops(self.device, self.policy, self.world_size, measure=self.rank0)
        # Every rank continues from the same RNG state (rank 0 alone drew random numbers to
        # time the peak), so dropout masks agree wherever activations are replicated (TP).
        torch.manual_seed(cfg.train.seed)

    def _start_run(self) -> None:
        """The run directory (this attempt not stopped, the tokenizer beside the
        checkpoints), the checkpoint resumed from, the stop policy and the metrics."""
        cfg = self.cfg
        self.lock = RunLock(self.run_dir)
        on_rank0(self.lock.acquire)  # before anything in the directory is touched
        if self.rank0:
            (self.run_dir / STOPPED).unlink(missing_ok=True)  # this attempt is not stopped
        self._resume()
        self.stop = StopSavePolicy(cfg.train, cfg.checkpoint.interval_steps, self.ckpt,
                                   self.device, self.stop_request)
        if self.rank0:
            tok = self.train_data.path / "tokenizer.json"
            if tok.exists():  # beside the checkpoints, for tools/export_hf.py
                (self.run_dir / "tokenizer.json").write_bytes(tok.read_bytes())
        self.metrics = MetricsLogger(
            self.run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)), self.budget.steps,
            self.step, cfg.logging.wandb, cfg.logging.wandb_project, cfg.logging.wandb_entity,
            cfg.logging.progress_bar, enabled=self.rank0,
        )

    def _log_startup_memory(self) -> None:
        """Peak host memory so far (model and optimizer state built, no step run): each
        rank holds O(its shard), never the whole model; the fullest rank is reported."""
        mine = float(peak_rss_bytes())
        most = max_over_ranks(torch.tensor(mine, device=self.device)).item()
        log.info("start-up peak host memory: %.2f GB on rank 0, %.2f GB on the fullest rank",
                 mine / 1e9, most / 1e9)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"step": self.step, "samples_seen": self.samples_seen,
                "first_val_loss": self.first_val_loss, **self.module.state_dict(),
                "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.first_val_loss = state.get("first_val_loss")
        self.module.load_state_dict(state)
        torch.set_rng_state(state["rng"])

    def _checkpoint_state(self) -> dict:
        return {"model_optim": ModelOptimizer(self.module.parts, self.module.optimizer),
                "train": self}

    def _resume(self) -> None:
        """Continue from ``resume_path``'s answer; else start a new run, from
        load_weights_only's weights when given."""
        path = self.resume_from
        if path is not None:
            meta = CheckpointManager.load(path, self._checkpoint_state())
            self.noise.restore(meta.get("noise_scale"))  # the estimate's EMAs, if saved
            log.info("resumed from %s: step %d, %s tokens seen (saved with layout %s)",
                     path, self.step, f"{self.step * self.budget.global_batch_tokens:,}",
                     meta.get("layout"))
            return
        if self.cfg.checkpoint.load_weights_only:
            load_weights(self.cfg.checkpoint.load_weights_only, self.cfg, self.module.parts,
                         self.plan["attention"])

    def save_checkpoint(self, block: bool = False) -> None:
        """A checkpoint of this step, unless the last step was skipped for a non-finite loss
        or gradient: no save then, so retention keeps the good ones (periodic, stop and
        final saves alike)."""
        if self.module.nonfinite_in_a_row:
            log.warning("step %d: no checkpoint while steps are being skipped for a "
                        "non-finite loss or gradient (%d in a row): the newest one, %s, "
                        "stays the last good one", self.step, self.module.nonfinite_in_a_row,
                        self.ckpt.latest())
            return
        meta = {"step": self.step, "tokens": self.step * self.budget.global_batch_tokens,
                "samples_seen": self.samples_seen, "layout": self.plan["layout"],
                "world_size": self.world_size, "branch": self.branch,
                "noise_scale": self.noise.estimator.state_dict(),
                "config": OmegaConf.to_container(OmegaConf.structured(self.cfg))}
        self.ckpt.save(self.step, self._checkpoint_state(), meta, block=block)

    # -- steps ---------------------------------------------------------------------------

    def _local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's slice of the global batch: samples are read by global index, so
        the union over ranks is exactly the batch one process would read."""
        n = self.layout.local_batch_size
        x, y = self.prefetch.get(self.samples_seen + self.place.dp_rank * n)  # read ahead
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
        rank's share of the loss, not reduced; the global grad norm), device tensors. On a
        logging step it also measures the noise scale, when the layout allows."""
        x, y = self._local_batch()
        measure = self.noise.measured and self.logging_step(self.step + 1)
        loss, grad_norm, small_sq = self.module.step(x, y, self.step + 1, measure)
        if measure:
            self.noise.record(small_sq, grad_norm)
        self.samples_seen += self.cfg.train.global_batch_size
        self.step += 1
        return loss, grad_norm

    def _check_nonfinite(self) -> None:
        self.module.check_nonfinite(self.step)

    def logging_step(self, step: int) -> bool:
        """Whether fit() logs after optimizer step ``step`` (1-based): the noise scale is
        measured on those steps only, whose host syncs and collectives are there anyway."""
        return step == 1 or step == self.budget.steps or step % self.cfg.logging.log_interval == 0

    def evaluate(self) -> float | None:
        """The mean validation loss (evaluation.Evaluator), None without one; on every rank."""
        return self.evaluator.evaluate() if self.evaluator is not None else None

    # -- loop ----------------------------------------------------------------------------

    def fit(self) -> dict:
        """The run: evaluate the starting model, then step after step: train, log (on
        logging steps), evaluate (when due), stop on a request or save (when due), until
        the budget is spent; then the final checkpoint, a sample and the result."""
        if self.step >= self.budget.steps:  # resumed from the final checkpoint
            return self._already_finished()
        stopped = self.stop_request.check(self.device)  # a signal during start-up
        if stopped is not None:
            log.warning("stop requested during start-up (%s): nothing trained since step %d, "
                        "exiting with status %d so the launcher requeues the run", stopped,
                        self.step, EXIT_REQUEUE)
            return self._exit_stopped(stopped)
        if self.evaluator is not None and self.rank0:
            self.evaluator.describe()
        self._evaluate_at_start()
        window, clock = LossWindow(self.device), Throughput()
        stopped = None
        collector = GarbageCollection(self.cfg.train.gc_interval)
        try:
            while self.step < self.budget.steps and stopped is None:
                stopped = self._train_one(window, clock, collector)
        finally:
            collector.close()
        if stopped is not None:
            return self._exit_stopped(stopped)
        return self._finish(window.final)

    def _train_one(self, window: LossWindow, clock: Throughput,
                   collector: GarbageCollection) -> str | None:
        """One step of fit's loop: train, log, evaluate, collect garbage, stop or save."""
        loss, grad_norm = self.train_step_local()
        window.add(loss, counted=torch.isfinite(grad_norm))
        clock.steps += 1
        self.metrics.advance()
        if self.logging_step(self.step):
            self._log_step(window, grad_norm, clock)
        if self.step % self.cfg.train.eval_interval == 0 or self.step == self.budget.steps:
            with clock.paused():  # eval time is not training throughput
                self._evaluate_and_log()
        collector.step(self.step)
        return self._stop_or_save()

    def _evaluate_at_start(self) -> None:
        """The untrained model's validation loss at step 0 (a resumed run's checkpoint has it)."""
        if self.step == 0:
            self._evaluate_and_log()
            self.first_val_loss = self.last_val_loss
        self.last_val_loss = self.first_val_loss

    def _log_step(self, window: LossWindow, grad_norm: torch.Tensor, clock: Throughput) -> None:
        """A logging step's line: mean loss since the last, throughput, noise scale (if any)."""
        tps = clock.rate(self.budget.global_batch_tokens)
        self._check_nonfinite()
        mean_loss, window.final = self._reduce_window(window)
        noise = self.noise.update(self.step)  # None: not measured, or not yet defined
        self.metrics.log({**self._step_metrics(mean_loss, grad_norm.item(), tps),
                          **({"noise_scale": noise} if noise is not None else {})})
        clock.restart()

    def _step_metrics(self, loss: float, grad_norm: float, tokens_per_s: float) -> dict:
        memory = memory_metrics(self.device, max_over_ranks)  # the fullest rank's
        mfu = self.peak.mfu(tokens_per_s * self.budget.flops_per_token)
        routing = self.module.routing_stats()  # MoE: expert load and auxiliary losses
        loads = [v for k, v in routing.items() if k.startswith("moe/max_load")]
        if loads:
            self.expert_loads.append(sum(loads) / len(loads))
        return {
            "step": self.step, "loss": loss, "lr": self.module.lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "mfu": mfu, **memory,
            "tokens": self.step * self.budget.global_batch_tokens,
            "loss_scale": self.module.loss_scale, "skipped_steps": self.module.skipped_steps,
            **routing,
        }

    def _reduce_window(self, window: LossWindow) -> tuple[float, float]:
        """(mean loss over the window's counted steps, the last step's loss), both global:
        one all-reduce and one host sync, on logging steps (every rank logs at the same
        steps). Starts a new window."""
        # every rank counted the same steps (the skip decision is global): not reduced
        total, last, counted = torch.cat([
            self.module.global_loss(torch.stack([window.total, window.last])),
            window.counted[None]]).tolist()
        mean = total / counted if counted else math.nan
        window.reset()
        return mean, last

    def _evaluate_and_log(self) -> None:
        self.last_val_loss = self.evaluate()
        m = {"step": self.step, "val_loss": self.last_val_loss,
             "tokens": self.step * self.budget.global_batch_tokens}
        for hook in self.hooks:  # validation per source (evaluation.SourceValidation)
            hook.evaluate(self, m)
        if m["val_loss"] is not None:
            self.metrics.log(m)

    def _stop_or_save(self) -> str | None:
        """After a step other than the last: why every rank stops now, having saved a
        checkpoint (blocking), or None, having saved a periodic one if it is due."""
        if self.step == self.budget.steps:  # the end of fit saves
            return None
        stopped, save_due = self.stop.after_step(self.step, self._check_nonfinite)
        if stopped is not None:
            log.warning("stopping at step %d (%s): saving a checkpoint, then exiting with "
                        "status %d so the launcher requeues the run", self.step, stopped,
                        EXIT_REQUEUE)
            self.save_checkpoint(block=True)
        elif save_due:
            self.save_checkpoint()
        return stopped

    def _exit_stopped(self, stopped: str) -> dict:
        """A run stopped early, to be requeued (preemption.requeue_exit)."""
        self.exit_code = requeue_exit(self.run_dir, self.step, stopped, self.rank0)
        self.ckpt.close()
        self.metrics.close()
        return {"steps": self.step, "stopped": stopped}

    def _already_finished(self) -> dict:
        """A finished run started again: nothing to train; result.json stays as it was."""
        path = self.run_dir / "result.json"
        log.info("this run finished already (step %d of %d, resumed from its final "
                 "checkpoint): nothing to train; %s is left as it was", self.step,
                 self.budget.steps, path)
        self.ckpt.close()
        self.metrics.close()
        if path.exists():
            return {**json.loads(path.read_text()), "already_finished": True}
        return {"steps": self.step, "already_finished": True}

    def _finish(self, final_loss: float) -> dict:
        """The budget is spent: final checkpoint, noise-scale verdict, hooks, sample, result."""
        self._check_nonfinite()
        if self.cfg.checkpoint.enabled:
            self.save_checkpoint(block=True)
        self.ckpt.close()
        tokens_per_step = self.budget.global_batch_tokens
        result = {"steps": self.step, "final_loss": final_loss,
                  "first_val_loss": self.first_val_loss, "final_val_loss": self.last_val_loss,
                  "tokens": self.step * tokens_per_step,
                  "skipped_steps": self.module.skipped_steps,
                  "val_batches": self.evaluator.batch_count() if self.evaluator else None,
                  "noise_scale": self.noise.value, "final_lr": self.module.lr,
                  **({"branch": self.branch} if self.branch else {})}
        if self.expert_loads:
            result["expert_max_load"] = sum(self.expert_loads) / len(self.expert_loads)
            log.info("expert load: the busiest expert of an MoE layer took %.2fx the mean "
                     "tokens (averaged over layers and the %d logged windows; 1 = balanced, "
                     "%s balancing)", result["expert_max_load"], len(self.expert_loads),
                     self.cfg.model.moe_balance)
        if self.noise.value is not None:
            log.info(compare_batch(tokens_per_step, self.noise.value))
        for hook in self.hooks:
            hook.finish(self, result)
        text = sample(self.module, self.cfg.train, self.train_data.path / "tokenizer.json",
                      self.device)
        if text is not None:
            log.info("sample from the trained model:\n%s\n%s\n%s", "-" * 60, text, "-" * 60)
            result["sample"] = text
        if self.rank0:
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        self.metrics.close()
        return result

    def close(self) -> None:
        """Give back what setup took, whatever happened: signal handlers, the read-ahead
        thread, the checkpoint worker, the run lock, the process group."""
        self.stop_request.restore()
        if self.prefetch is not None:
            self.prefetch.close()
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()
        if self.lock is not None:
            self.lock.release()
        leave()


def run(cfg: Config, run_dir: Path) -> dict | None:
    """Entry point shared by train.py and the tools: dry run or train (one process, or one
    of the processes torchrun started)."""
    if cfg.dry_run:
        return dry_run(cfg)
    trainer = Trainer(cfg, run_dir)
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
