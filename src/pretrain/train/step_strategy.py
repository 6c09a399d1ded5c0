"""How a training step runs its forwards and backwards, chosen once per run from the layout.

Two strategies, as torchtitan separates ``forward_backward_step`` from
``pp_forward_backward_step``: ``AccumulationStep`` runs this rank's whole model over the micro
batches of its batch, accumulating gradients (and choosing when DDP / ZeRO-2 reduce them);
``PipelineStep`` hands the batch to a ``torch.distributed.pipelining`` schedule, which runs
every micro batch's forward and backward itself (and owns the schedule and its loss). Each
also owns its evaluation forwards. The train module (train_module.py) picks one at setup
(``step_strategy``); nothing above it asks which it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from pretrain.model.moe import aux_loss_scale, moe_layers
from pretrain.parallel.apply import ParallelModel
from pretrain.parallel.layout import Layout
from pretrain.parallel.pipeline import build_schedule
from pretrain.parallel.tensor_parallel import loss_context


def local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (a loss under loss_parallel)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ScaledLoss:
    """The pipeline schedule's loss function. The schedule runs backward on it itself, so
    fp16 loss scaling multiplies it here, while ``scale`` is set: during training steps
    only (``PipelineStep.forward_backward`` sets it). With z-loss (``terms``), training
    steps (``training`` set) return cross-entropy + z-loss term, and keep both, detached,
    in ``kept`` (the schedule's ``losses`` hold the sums)."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 terms: Callable | None = None):
        self.scale: float | None = None
        self.fn, self.terms = loss, terms
        self.training = False
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.training and self.terms is not None:
            ce, z = self.terms(logits, targets)
            self.kept.append((local(ce.detach()), local(z.detach())))
            loss = ce + z
        else:
            loss = self.fn(logits, targets)
        return loss if self.scale is None else loss * self.scale


class AccumulationStep:
    """The whole model on this rank (no pipeline): micro batches one after another, their
    gradients accumulated. DDP and ZeRO-2 (``defer_reduction``) reduce the gradients once,
    in the last micro batch's backward.

    On a step that measures the gradient noise scale it also returns the squared norm of
    the first micro batch's mean gradient (see services/noise_probe.NoiseScaleProbe): a batch that
    is one micro batch then runs as two halves (``small_seqs`` sequences first, each
    weighted by its size; under a batch ramp that starts at one micro batch, the first micro
    batch of every measuring step does, so the small batch keeps its size), and DDP/ZeRO-2 reduce
    the first micro batch's gradients at once
    instead of with the last's. Evaluation: one micro batch a forward, counted one by one
    (``eval_sizes``: 1, 1)."""

    def __init__(self, parallel: ParallelModel, scaler, small_seqs: int | None,
                 grad_sq_norm: Callable[[], torch.Tensor]):
        self.parallel, self.layout, self.device = parallel, parallel.layout, parallel.device
        self.scaler, self.small_seqs, self.grad_sq_norm = scaler, small_seqs, grad_sq_norm
        self.has_moe = bool(moe_layers(self.model))  # fp16 + MoE: the scale, read per step
        self.z_total: torch.Tensor | None = None  # the last step's z-loss term (z-loss runs)

    @staticmethod
    def eval_sizes(layout: Layout) -> tuple[int, int]:
        """(micro batches one evaluation call computes, batches over every DP rank that
        one evaluation round computes anyway)."""
        return 1, 1

    @property
    def defer_reduction(self) -> bool:
        """DDP and ZeRO-2 reduce gradients when told to (once a step); ZeRO-3 reduce-scatters
        in every backward, one process has nothing to reduce."""
        return self.layout.dp > 1 and self.layout.dp_spec.defers_reduction

    @property
    def model(self) -> torch.nn.Module:
        return self.parallel.parts[0]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, measure: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the mean loss over this rank's batch; returns (that loss, the first
        micro batch's squared gradient norm when ``measure``, else None)."""
        # this step's micro batches: the layout's, or fewer during a batch ramp
        n = len(x) // self.layout.micro_batch_size
        if measure and n == 1 and (self.small_seqs or 0) >= len(x):  # a ramp's cut last step:
            measure = False  # no smaller batch of the probe's size in it, not measured
        chunks, split = self._micro_batches(x, y, measure)
        pm = self.parallel
        total = torch.zeros((), device=self.device)
        z_total = self.z_total = None if not pm.z_loss else torch.zeros((), device=self.device)
        small_sq = None
        # one autocast region for the step: each weight is cast once, not once a micro batch
        with loss_context(self.layout.tp), pm.autocast():
            for i, (xs, ys) in enumerate(chunks):
                self._sync_gradients(i == len(chunks) - 1 or (measure and i == 0))
                weight = len(xs) / len(x) if split else 1 / n
                loss, z = pm.micro_batch_terms(xs, ys)
                reported = loss
                if z is not None:  # z-loss: in the objective, not in the reported loss
                    z_total += local(z.detach()) * weight
                    loss = loss + z
                # an ordinary step divides by n: the same bits as before the halves existed
                loss = loss * weight if split else loss / n
                # an MoE layer's auxiliary losses count as this micro batch's loss does
                unit = (weight if split else 1 / n) * (
                    self.scaler.get_scale() if self.scaler and self.has_moe else 1.0)
                with aux_loss_scale(unit), pm.autocast(enabled=False):
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                total += local(loss.detach()) if z is None else local(reported.detach()) * weight
                if measure and i == 0:
                    # the mean gradient of this micro batch: the loss was weighted
                    small_sq = self.grad_sq_norm() / weight ** 2
        return total, small_sq

    def _micro_batches(self, x: torch.Tensor, y: torch.Tensor, measure: bool
                       ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
        """This rank's batch in micro batches, and whether they are the two halves of a
        measuring step of one micro batch (weighted by their sizes then)."""
        m = self.layout.micro_batch_size
        n = len(x) // m
        if (
            measure and self.small_seqs is not None and self.small_seqs < m
        ):  # the first micro batch run as two halves
            k = self.small_seqs
            rest = list(zip(x[m:].chunk(n - 1), y[m:].chunk(n - 1), strict=True)) if n > 1 else []
            return [(x[:k], y[:k]), (x[k:m], y[k:m]), *rest], True
        return list(zip(x.chunk(n), y.chunk(n), strict=True)), False

    def _sync_gradients(self, reduce_now: bool) -> None:
        """DDP / ZeRO-2: reduce the gradients in this backward only when ``reduce_now``."""
        if self.defer_reduction:
            self.model.set_requires_gradient_sync(reduce_now)

    def eval_losses(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
        """The loss of one validation micro batch, as a one-element list."""
        with loss_context(self.layout.tp), torch.no_grad(), self.parallel.autocast():
            return [local(self.parallel.micro_batch_loss(x, y))]

    def token_logprobs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each position's log-probability of its target, fp32, through the model as the
        validation loss runs it (the compute dtype's autocast); TP's vocabulary-sharded
        logits are gathered first (an evaluation batch's, not a training one's)."""
        with torch.no_grad(), self.parallel.autocast():
            logits = local(self.model(x)).float()
        return -F.cross_entropy(logits.flatten(0, -2), y.flatten(),
                                reduction="none").view_as(y)


class PipelineStep:
    """This rank's pipeline stages, driven by the schedule: one ``schedule.step`` runs
    every micro batch's forward and backward. The loss exists on the last stage only;
    other ranks return zero. Evaluation runs whole pipeline steps of forwards
    (microbatches batches a call), and counts every micro batch they compute
    (dp x microbatches batches over every DP rank). It builds the schedule around its own
    loss, which fp16 scales during training steps."""

    def __init__(self, parallel: ParallelModel, scaler, optimizer: torch.optim.Optimizer):
        self.parallel, self.layout, self.device = parallel, parallel.layout, parallel.device
        self.scaler, self.optimizer = scaler, optimizer
        self.loss = ScaledLoss(parallel.loss, parallel.terms if parallel.z_loss else None)
        self.z_total: torch.Tensor | None = None  # the last step's z-loss term (z-loss runs)
        self.schedule = build_schedule(parallel.parts, parallel.stage_ids, self.layout,
                                       parallel.mesh.pp, self.device, self.loss)
        # a batch ramp's smaller steps: one schedule per micro batch count, built on first
        # use (the same stages' modules; the micro batch keeps its shape)
        self.schedules = {self.layout.microbatches: self.schedule}

    def _schedule(self, n: int):
        """The schedule of ``n`` micro batches (the layout's, or a batch ramp's fewer)."""
        if n not in self.schedules:
            pm = self.parallel
            self.schedules[n] = build_schedule(
                pm.parts, pm.stage_ids, dataclasses.replace(self.layout, microbatches=n),
                pm.mesh.pp, self.device, self.loss)
        return self.schedules[n]

    @staticmethod
    def eval_sizes(layout: Layout) -> tuple[int, int]:
        return layout.microbatches, layout.dp * layout.microbatches

    def _args(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list, torch.Tensor | None]:
        """The schedule's inputs on this rank: the tokens on the first stage, the targets
        on the last."""
        pm = self.parallel
        return [x] if pm.has_first_stage else [], y if pm.has_last_stage else None

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, measure: bool = False
                         ) -> tuple[torch.Tensor, None]:
        """Gradients of the mean loss over this rank's batch; returns (that loss, zero on
        ranks without the last stage; None: the noise scale is not measured under PP)."""
        pm = self.parallel
        losses: list[torch.Tensor] = []
        args, target = self._args(x, y)
        with loss_context(self.layout.tp):
            if self.scaler:  # scale() also creates the scaler's state on first use
                self.scaler.scale(torch.ones((), device=self.device))
                self.loss.scale = self.scaler.get_scale()
            self.loss.training, self.loss.kept = True, []
            try:  # return_outputs=False: the last stage keeps no micro batch's logits
                # the schedule divides every gradient by the micro batch count itself
                with aux_loss_scale(self.loss.scale or 1.0):
                    self._schedule(len(x) // self.layout.micro_batch_size).step(
                        *args, target=target, losses=losses,
                                       return_outputs=False)
            finally:
                scale, self.loss.scale = self.loss.scale or 1.0, None
                self.loss.training = False
            if not pm.has_last_stage:
                self.z_total = torch.zeros((), device=self.device) if pm.z_loss else None
                return torch.zeros((), device=self.device), None
            if pm.z_loss:  # the reported loss is the cross-entropy alone; the last
                # len(losses) calls are this step's micro batches (the schedule's first
                # step also calls the loss to infer shapes)
                kept = self.loss.kept[-len(losses):]
                ce, self.z_total = torch.stack([torch.stack(k) for k in kept]).mean(0)
                return ce, None
            return torch.stack([local(loss.detach()) for loss in losses]).mean() / scale, None

    def eval_losses(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
        """The losses of one pipeline step of validation micro batches, on the last stage;
        None on the other ranks."""
        losses: list[torch.Tensor] = []
        with loss_context(self.layout.tp):
            self._eval_step(x, y, losses)
            if not self.parallel.has_last_stage:
                return None
            return [local(loss.detach()) for loss in losses]

    def token_logprobs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("per-token log-probabilities under pipeline parallelism "
                                  "(downstream task scoring) are not implemented yet")

    def _eval_step(self, x: torch.Tensor, y: torch.Tensor, losses: list) -> None:
        """One pipeline step of forwards; the per micro batch losses land in ``losses`` on
        the last stage. Only the losses are needed, so the schedule returns no outputs."""
        schedule = self.schedule
        args, target = self._args(x, y)
        if self.layout.pp_schedule != "zbv":
            with torch.no_grad():
                schedule.eval(*args, target=target, losses=losses, return_outputs=False)
            return
        # torch 2.13's eval() runs ZBV's backward actions and fails; take a full step and
        # discard its gradients (evaluation runs between steps, when there are none).
        schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self.optimizer.zero_grad(set_to_none=True)


def strategy_class(layout: Layout) -> type[AccumulationStep] | type[PipelineStep]:
    """A pipeline schedule's strategy when the model is split into stages, else gradient
    accumulation."""
    return PipelineStep if layout.pp > 1 else AccumulationStep


def step_strategy(parallel: ParallelModel, scaler, *, optimizer: torch.optim.Optimizer,
                  small_seqs: int | None, grad_sq_norm: Callable[[], torch.Tensor]
                  ) -> AccumulationStep | PipelineStep:
    """The run's step strategy, decided once at setup. (``optimizer`` serves the pipeline's
    ZBV evaluation, ``small_seqs`` and ``grad_sq_norm`` the noise scale measured under
    accumulation.)"""
    if strategy_class(parallel.layout) is PipelineStep:
        return PipelineStep(parallel, scaler, optimizer)
    return AccumulationStep(parallel, scaler, small_seqs, grad_sq_norm)
