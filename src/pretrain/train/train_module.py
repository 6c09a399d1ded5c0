"""The train module: what a training step needs and the loop never looks inside.

It owns this rank's parallel model, the optimizer, the LR schedule, fp16's loss scaler and
the step strategy (step_strategy.py), and offers the loop a small interface: ``join`` (this
process's place in the run), ``step`` (one optimizer step), ``eval_losses``,
``global_loss`` / ``sum_over_dp`` and ``state_dict``. Everything that depends on the layout
(which ranks hold the loss, tied copies, the pipeline group and schedule, ZeRO's scaler)
is answered here or below, in ``parallel/``, as OLMo-core's ``TrainModule`` and
torchtitan's ``ModelWrapper``/``OptimizersContainer`` keep it out of their trainers: a new
layout technique touches ``parallel/`` and the step strategies, not the loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pretrain import torch_compat
from pretrain.budget.batch_ramp import RampSpec
from pretrain.config.observe_schema import CommConfig
from pretrain.config.schema import Config
from pretrain.model.initialization import local_region
from pretrain.model.moe import routing_stats, update_biases
from pretrain.optim.factory import TokenLR, build_scheduler
from pretrain.optim.nonfinite import (
    NonFiniteSteps,
    device_skip_supported,
    nonfinite_advice,
    step_unless,
)
from pretrain.optim.specs import build_optimizer
from pretrain.optim.spike_guard import SpikeGuard
from pretrain.parallel import mesh as dist_env
from pretrain.parallel.apply import ParallelModel, materialize, parallelize_gpt
from pretrain.parallel.layout import Layout
from pretrain.parallel.mesh import Meshes
from pretrain.planning.graphs import decide_cuda_graphs
from pretrain.precision.fp8 import after_optimizer_step, fp8_all_gather
from pretrain.precision.policy import Policy
from pretrain.train.step_strategy import step_strategy, strategy_class

log = logging.getLogger("pretrain")


@dataclass
class Place:
    """This process's place in the run."""

    device: torch.device  # cuda:LOCAL_RANK under a launcher on GPUs
    mesh: Meshes | None  # None: one process without a process group
    rank0: bool  # the one voice of the log and the one writer of files
    dp_rank: int  # which slice of each global batch this rank reads
    rank: int = 0  # the global rank


def join(layout: Layout, device: torch.device, policy: Policy, world_size: int,
         comm=None) -> Place:
    """The process group and device mesh (several processes; one process too whenever it
    is not ``Layout.one_device``: with ``parallel.offload=params`` FSDP2 is what brings the
    host's parameters to the GPU for each block; without the group an offloaded run kept its
    weights on the host while its batches went to the GPU: "index is on cuda:0, different
    from other tensors on cpu"), and this rank's place in them. One process otherwise runs
    without a process group or wrapper. ``comm``: the run's timeouts (comm.*)."""
    mesh = None
    if world_size > 1 or not layout.one_device:
        timeout_s = (comm or CommConfig()).init_timeout_s  # the default written once
        device = dist_env.init_distributed(device, timeout_s)
        mesh = dist_env.build_mesh(layout, device)
    dp_rank = mesh.dp.get_local_rank() if mesh is not None else 0
    return Place(device, mesh, dist_env.is_rank0(), dp_rank, dist_env.rank())


def max_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` (in place) as its maximum over every rank: the fullest rank's memory."""
    return dist_env.all_reduce(value, "max")


def leave() -> None:
    """Leave the process group, if this process joined one."""
    dist_env.destroy()


class TrainModule:
    """This rank's model, optimizer, schedule, loss scaler and step strategy.

    Built from the resolved config and plan values: ``attention`` (the kernel), ``lr`` (the
    scaled peak LR), ``steps`` and ``batch_tokens`` (the schedule's length and warmup
    unit). ``initialise`` False allocates the weights without drawing them (a checkpoint is
    about to overwrite them); ``last_good()`` names the newest checkpoint for the error
    that stops a run after too many non-finite steps."""

    def __init__(self, cfg: Config, layout: Layout, place: Place, policy: Policy, *,
                 attention: str, lr: float, steps: int, batch_tokens: int, initialise: bool,
                 last_good: Callable[[], object] = lambda: None, ramp: RampSpec | None = None):
        self.cfg, self.layout, self.policy = cfg, layout, policy
        self.last_good = last_good
        self.peak_lr = lr  # for the advice of a non-finite stop
        self.device = place.device
        self.parallel = self._build_model(place.mesh, attention, initialise)
        self.optimizer = build_optimizer(
            torch.nn.ModuleList(self.parts), cfg.optim, lr, self.parallel.param_device,
            also_embeddings=self.parallel.tied.params if self.parallel.tied is not None else (),
        )
        # a batch ramp's schedule runs in tokens, its LR x the batch's factor (TokenLR.place)
        self.ramp = ramp
        self.scheduler = (
            build_scheduler(self.optimizer, cfg.schedule, steps, batch_tokens)
            if ramp is None
            else TokenLR(self.optimizer, cfg.schedule, steps, batch_tokens,
                         (ramp.start * ramp.seq_len, ramp.lr_factor(ramp.start)))
        )
        self.scaler = self._grad_scaler(place.mesh)
        self.skipped_steps = 0
        self.nonfinite_in_a_row = 0
        self.skips = NonFiniteSteps(self.device, self.skipped_steps)
        o = cfg.optim  # optim.spike_guard: loss / grad-norm outliers skipped too
        self.guard = (
            SpikeGuard(self.device, o.spike_sigmas, o.spike_window, o.spike_warmup)
            if o.spike_guard
            else None
        )
        self.strategy = step_strategy(self.parallel, self.scaler, optimizer=self.optimizer,
                                      small_seqs=None, grad_sq_norm=self.grad_sq_norm)
        self._measure_next = False  # measure_next: the next step measures the small batch
        # the last step's small-batch squared gradient norm (None: not measured) and its
        # global grad norm before clipping, device tensors (services/noise_probe.py)
        self.small_sq: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None
        # micro batches one evaluation call computes, and batches one round computes anyway
        self.eval_chunk, self.eval_round = strategy_class(layout).eval_sizes(layout)
        # FSDP fp8 all-gathers: weight scales precomputed once per step, in one all-reduce
        self.fp8_scales = policy.fp8 and any(fp8_all_gather(p) for p in self.parts)

    def _build_model(self, mesh: Meshes | None, attention: str, initialise: bool
                     ) -> ParallelModel:
        """Meta-device GPT -> this rank's parallel share -> its shards allocated and (unless
        a checkpoint is about to overwrite them) initialised, each rank drawing only its own
        shards' values."""
        cfg = self.cfg
        graphs = decide_cuda_graphs(cfg, self.layout, self.device.type)  # train.cuda_graphs
        pm = parallelize_gpt(cfg, self.layout, mesh, self.device, self.policy, attention,
                             graphs)
        t0 = time.perf_counter()
        materialize(pm, self.device, cfg.train.seed if initialise else None)
        # Under CUDA graphs the gradients stay allocated from step to step: a replayed
        # backward's outputs are the graph's own memory, which the next micro batch's replay
        # (a new cudagraph-trees iteration) overwrites; autograd adds them into a gradient
        # that exists, in place, before that, instead of keeping the output itself as .grad
        self.keep_grads = graphs
        if graphs:
            for p in pm.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        if initialise:
            log.info("initialised this rank's shards in %.2f s (%.1f MB of parameters)",
                     time.perf_counter() - t0, sum(local_region(p)[0].nbytes
                                                   for p in pm.parameters()) / 1e6)
        return pm

    def _grad_scaler(self, mesh: Meshes | None):
        if not self.policy.loss_scaling:
            return None
        if mesh is None:
            return self.policy.grad_scaler(self.device)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # found-inf must agree on every rank, or some would skip a step others take
        return ShardedGradScaler(self.device.type)

    # -- the model as the services see it ------------------------------------------------

    @property
    def parts(self) -> list[torch.nn.Module]:
        """This rank's model chunks: one module, or its pipeline stages."""
        return self.parallel.parts

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model as one module: the whole GPT, or its pipeline stage (parameter
        names are the whole model's either way). A rank holding several stages
        (interleaved, ZBV) has no single module: use ``parts``."""
        if len(self.parts) != 1:
            raise AttributeError(f"this rank holds pipeline stages {self.parallel.stage_ids}; "
                                 "use TrainModule.parts")
        return self.parts[0]

    def autocast(self):
        """The forwards' compute-dtype context (``ParallelModel.autocast``): what evaluation
        and generation run under, as training does."""
        return self.parallel.autocast()

    def generator_model(self) -> tuple[torch.nn.Module | None, str]:
        """The model ``generate`` can run on this rank, or None and why not: generation
        runs on unsplit models (tp=1, pp=1) only."""
        if self.layout.pp > 1 or self.layout.tp > 1:
            return None, "generation runs on unsplit models (tp=1, pp=1) only"
        return self.model, ""

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler else None

    # -- reductions ----------------------------------------------------------------------

    def sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """See ``ParallelModel.sum_over_dp``: every rank calls it at the same point."""
        return self.parallel.sum_over_dp(value)

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over DP ranks of ``loss`` as ``step`` returns it (any shape: a stack of
        losses takes one all-reduce), the same on every rank. Every rank must call it, at
        the same point."""
        return self.sum_over_dp(loss) / self.layout.dp

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared norm of the gradients held now, global (every DP and TP shard), unscaled
        from fp16 loss scaling; a device tensor (no host sync)."""
        sq = self.parallel.grad_sq_norm()
        if self.scaler is not None:
            scale = torch_compat.private("grad_scaler_scale_async")(self.scaler)
            sq = sq / scale.float() ** 2
        return sq

    # -- the step ------------------------------------------------------------------------

    def probe_small_batch(self, small_seqs: int) -> None:
        """The noise scale's small batch per DP rank (sequences): a measuring step of one
        micro batch runs it as its first half (step_strategy.AccumulationStep)."""
        self.strategy.small_seqs = small_seqs

    def measure_next(self) -> None:
        """The next ``step`` also measures the first micro batch's squared gradient norm
        (``small_sq``), as ``step(measure=True)`` does."""
        self._measure_next = True

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int, measure: bool = False,
             samples_after: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Optimizer step number ``step`` (1-based) over this rank's batch ``x``, ``y``;
        returns (this rank's share of the loss, a detached device tensor, not reduced: see
        global_loss; the global grad norm before clipping, on the device; when ``measure``,
        the first micro batch's squared gradient norm for the noise scale, else None).

        No host sync with a fused optimizer (the GPU default): the grad norm is reduced over
        the whole model inside clip_grad_norm, and it is not finite whenever the loss is not
        (a NaN or inf loss back-propagates into the gradients, and every rank's norm covers
        every gradient), so every rank skips a non-finite step on the device
        (pretrain/optim/nonfinite.py). A non-fused optimizer reads the decision on the host.
        Under a batch ramp ``samples_after`` (global samples consumed once this step is done)
        places the step's LR (TokenLR)."""
        self.parallel.train()
        measure, self._measure_next = measure or self._measure_next, False
        if self.ramp is not None:  # this step's LR: its batch, the tokens it ends at
            batch = len(x) * self.layout.dp
            self.scheduler.place(samples_after * self.ramp.seq_len, self.ramp.lr_factor(batch))
        loss, small_sq = self.strategy.forward_backward(x, y, measure)
        grad_norm = self._clipped_grad_norm().detach()
        self.small_sq, self.grad_norm = small_sq, grad_norm
        self._update(grad_norm, step, loss.detach())
        for part in self.parts:  # aux_free MoE layers: their biases follow the step's load
            update_biases(part, self.parallel.sum_over_replicas)
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        self.scheduler.step()
        return loss.detach(), grad_norm, small_sq

    def routing_stats(self) -> dict[str, float]:
        """MoE layers' load (busiest expert over the mean) since the last call and their
        auxiliary losses (moe.routing_stats; a host read: on logging steps)."""
        if not self.cfg.model.moe_experts:  # dense: nothing to read, no collective
            return {}
        local = {k: v for part in self.parts for k, v in
                 routing_stats(part, self.parallel.sum_over_replicas).items()}
        return self.parallel.gather_over_stages(local)

    def _clipped_grad_norm(self) -> torch.Tensor:
        """The whole model's gradients made whole (tied embeddings summed, fp16 unscaled)
        and clipped; returns their global norm before clipping, on the device."""
        grad_clip = self.cfg.optim.grad_clip
        unscale = (lambda: self.scaler.unscale_(self.optimizer)) if self.scaler else None
        return self.parallel.clip_grad_norm(grad_clip if grad_clip > 0 else math.inf, unscale)

    def _update(self, grad_norm: torch.Tensor, step: int, loss: torch.Tensor) -> None:
        """The optimizer step, unless the gradients are not finite (or, with the spike
        guard, the loss or grad norm is an outlier): fp16's scaler skips a non-finite step
        itself (and lowers the scale); otherwise a fused optimizer skips it on the device,
        and a non-fused one here, after reading the decision."""
        if self.scaler:  # fp16: the scaler skips steps with inf/nan gradients itself
            self._scaler_step(step)
            return
        finite = take = torch.isfinite(grad_norm)
        if self.guard is not None:  # the global loss: every rank decides the same
            loss = self.global_loss(loss)
            ok = self.guard.ok(loss, grad_norm)
            take = finite & ok
        on_host = None if device_skip_supported(self.optimizer) else bool(take.item())
        if on_host is None:
            step_unless(self.optimizer, take)
        elif on_host:
            self.optimizer.step()
        self.skips.add(finite)
        if self.guard is not None:
            self.guard.record(loss, grad_norm, finite, ok)
        if self.fp8_scales:
            after_optimizer_step(self.parts)
        if on_host is False:
            self.check_nonfinite(step)  # read on the host already: warn at once

    def _scaler_step(self, step: int) -> None:
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # the documented sign of a skipped step
            self.skipped_steps += 1
            log.warning("step %d: fp16 gradients overflowed (inf/nan), step skipped on "
                        "every rank; loss scale %g -> %g (%d skipped in all)",
                        step, scale, self.scaler.get_scale(), self.skipped_steps)

    def check_nonfinite(self, step: int) -> None:
        """Read the device-side skip counts (a host sync: on steps that sync anyway), warn
        about skipped steps, and stop after ``train.max_nonfinite_steps`` in a row, naming
        ``last_good()``, the newest checkpoint."""
        if self.scaler:  # fp16: counted by the scaler's path, on the host
            return
        limit = self.cfg.train.max_nonfinite_steps
        self._settle_spikes(step)
        longest = self.skips.settle(step, limit)
        self.skipped_steps, self.nonfinite_in_a_row = self.skips.skipped, self.skips.in_a_row
        if longest >= limit:
            self.optimizer.zero_grad(set_to_none=True)
            last = self.last_good()
            raise FloatingPointError(
                f"{longest} steps in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={limit}); stopping. The last good checkpoint "
                f"{last or '(none saved)'} is intact: "
                f"{nonfinite_advice(self.cfg.optim, self.peak_lr, self.policy.fp8)}.")

    def _settle_spikes(self, step: int) -> None:
        """Read the spike guard's count (on the steps that read the non-finite counts) and
        warn about spikes skipped since the last read."""
        if self.guard is None:
            return
        before = self.guard.skipped
        new = self.guard.settle() - before
        if new:
            log.warning("%d step(s) up to step %d skipped: loss or gradient norm above the "
                        "mean + %g sigma of the last %d steps taken (optim.spike_guard; "
                        "%d in all)", new, step, self.guard.sigmas, self.guard.size,
                        self.guard.skipped)

    def step_counts(self, logging: bool = False) -> dict:
        """The skip counts for the log line and result.json (``spike_skipped_steps`` with
        the spike guard on); on a logging step also the last step's z-loss term, global
        (an all-reduce: every rank calls this at the same point)."""
        counts = {"skipped_steps": self.skipped_steps}
        if self.guard is not None:
            counts["spike_skipped_steps"] = self.guard.skipped
        z = getattr(self.strategy, "z_total", None)
        if logging and z is not None:
            counts["z_loss"] = self.global_loss(z).item()
        return counts

    def guard_state(self) -> dict | None:
        """The spike guard's window and count, for the checkpoint's meta (None: off)."""
        return self.guard.state_dict() if self.guard is not None else None

    def restore_guard(self, state: dict | None) -> None:
        """The spike guard as ``guard_state`` saved it (a checkpoint without one, or with
        the guard off: the window starts empty)."""
        if self.guard is not None:
            self.guard.load_state_dict(state)

    def eval_losses(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
        """The losses of one evaluation call (``eval_chunk`` micro batches), on the ranks
        that hold the loss; None on the others."""
        self.parallel.train(False)
        return self.strategy.eval_losses(x, y)

    def token_logprobs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each position's log-probability of its target ([B, T], fp32), through this
        rank's model in evaluation mode: downstream task scoring (train/downstream.py).
        Every rank of a DP group calls it together (FSDP gathers in the forward)."""
        self.parallel.train(False)
        return self.strategy.token_logprobs(x, y)

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.skips = NonFiniteSteps(self.device, self.skipped_steps)
        self.scheduler.load_state_dict(state["scheduler"])
        # The next step's LR by this run's schedule, not by the saved run's: a cooldown
        # branch decays where its source stayed at the peak (a resume gets the same LR).
        # DCP loads "model_optim" (the optimizer's saved LRs) before this.
        self.scheduler.last_epoch -= 1
        self.scheduler.step()
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
