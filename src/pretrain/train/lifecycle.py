"""What a run takes before its first step and gives back after its last: the steps of the
trainer's ``setup`` (read the data; build the train module, the validation and the MFU
denominator; the hooks' view of the run; resume or start afresh, open the metrics) and its
``close``. The loop itself is trainer.py's, and so is ``setup``'s order; this is the part
of the trainer that is not the loop, kept apart so the loop reads top to bottom.
``Lifecycle`` is the trainer's base: its methods set and read the trainer's own attributes
(``Trainer.__init__`` lists them)."""

from __future__ import annotations

import logging

import torch
from omegaconf import OmegaConf

from pretrain.checkpoint.folder import on_rank0
from pretrain.data.prefetch import Prefetcher
from pretrain.data.run_data import mixture_training_data, training_data
from pretrain.hardware.device import inductor_cache_per_isa, keep_freed_memory
from pretrain.train.checkpointing import Checkpointing
from pretrain.train.evaluation import validation
from pretrain.train.hooks import LoopContext
from pretrain.train.metrics import MetricsLogger, PeakFlops, log_startup_memory
from pretrain.train.preemption import STOPPED, StopSavePolicy
from pretrain.train.run_lock import RunLock
from pretrain.train.train_module import TrainModule, leave, max_over_ranks

log = logging.getLogger("pretrain")


class Lifecycle:
    """The trainer's setup and close (see the module's docstring)."""

    def _load_data(self) -> None:
        """The training and (when prepared) validation windows, read ahead on a thread."""
        cfg = self.cfg
        if cfg.data.mixture:  # data/mixture_windows.py, for the decided weights over steps
            # each source's validation split: evaluation.validation opens them
            self.train_data, epochs = mixture_training_data(
                cfg, self.decision, self.world_size, self.budget.steps, self.batches.sizes)
            self.val_data = None
        else:
            self.train_data, self.val_data, epochs = training_data(cfg, self.world_size,
                                                                   self.budget.tokens)
        self.plan.update(epochs)  # the report: the data's size once it exists
        # the next batches read on a thread while a step runs, pinned for async copies
        self.prefetch = Prefetcher(self.train_data, self.layout.local_batch_size,
                                   cfg.train.global_batch_size, pin=self.device.type == "cuda",
                                   plan=self.batches.plan(self.layout.dp, self.place.dp_rank))
        if self.device.type == "cpu":
            keep_freed_memory()
            inductor_cache_per_isa()

    def _build_training(self) -> None:
        """The train module, the validation and the MFU denominator."""
        cfg, layout = self.cfg, self.layout
        self.checkpoints = Checkpointing(cfg, self.run_dir, self.device,
                                         keep_steps=self.decision.branch_points)
        self.ckpt, self.branch = self.checkpoints.manager, self.checkpoints.branch
        self.module = TrainModule(
            cfg, layout, self.place, self.policy, attention=self.decision.attention,
            lr=self.decision.lr, steps=self.budget.steps,
            batch_tokens=self.budget.global_batch_tokens,
            initialise=self.checkpoints.resume_from is None,
            last_good=lambda: self.ckpt.latest() if cfg.checkpoint.enabled else None,
            ramp=self.run.ramp)
        self.validation = validation(cfg, self.module, dp_rank=self.place.dp_rank,
                                     device=self.device, own=self.val_data)
        log_startup_memory(self.device, max_over_ranks)
        self.peak = PeakFlops(self.device, self.policy, self.world_size, measure=self.rank0,
                              kept=self.run_dir / "cpu_peak.json" if cfg.ft.mode == "torchft"
                              else None)  # a torchft group's returns start under nice
        # Every rank continues from the same RNG state (rank 0 alone drew random numbers to
        # time the peak), so dropout masks agree wherever activations are replicated (TP).
        torch.manual_seed(cfg.train.seed)

    def _context(self) -> LoopContext:
        """The hooks' view of the run (hooks.LoopContext): facts, the live step, record."""
        return LoopContext(
            cfg=self.cfg, module=self.module, device=self.device, rank0=self.rank0,
            layout=self.layout, dp_rank=self.place.dp_rank, world_size=self.world_size,
            total_steps=self.batches.total_steps, batch_tokens=self.budget.global_batch_tokens,
            tokenizer=self.train_data.path / "tokenizer.json", logs=self.logging_step,
            _step=lambda: self.step, _samples=lambda: self.samples_seen, _batches=self.batches,
            run_dir=self.run_dir, timing=self.timing, rank=self.place.rank)

    def _start_run(self) -> None:
        """The run directory (this attempt not stopped, the tokenizer beside the
        checkpoints), the checkpoint resumed from, the stop policy and the metrics."""
        cfg = self.cfg
        self.lock = RunLock(self.run_dir)
        on_rank0(self.lock.acquire)  # before anything in the directory is touched
        if self.rank0:
            (self.run_dir / STOPPED).unlink(missing_ok=True)  # this attempt is not stopped
        self.checkpoints.resume(self)
        self.stop = StopSavePolicy(cfg.train, cfg.checkpoint.interval_steps, self.ckpt,
                                   self.device, self.stop_request)
        if self.rank0:
            tok = self.train_data.path / "tokenizer.json"
            if tok.exists():  # beside the checkpoints, for tools/export_hf.py
                (self.run_dir / "tokenizer.json").write_bytes(tok.read_bytes())
        self.metrics = MetricsLogger(
            self.run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)),
            self.batches.total_steps, self.step, cfg.logging.wandb, cfg.logging.wandb_project,
            cfg.logging.wandb_entity, cfg.logging.progress_bar, enabled=self.rank0,
        )

    def close(self, leave_group: bool = True) -> None:
        """Give back what setup took, whatever happened: signal handlers, the hooks, the
        read-ahead thread, the checkpoint worker, the run lock, the process group (unless
        not ``leave_group``: a test running several layouts in one)."""
        self.stop_request.restore()
        self._close_hooks()
        if self.prefetch is not None:
            self.prefetch.close()
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()
        if self.lock is not None:
            self.lock.release()
        if leave_group:
            leave()
