"""Pipeline parallelism with torch.distributed.pipelining, split the torchtitan way.

Each pipeline stage is a copy of the meta-device GPT with the layers it does not own deleted
(layers are keyed by global index, so parameter names stay those of the whole model and a
checkpoint reshards across layouts); the first stage keeps the embeddings, the last the
final norm and head. Stages are balanced by layer count. Ranks hold one stage (GPipe, 1F1B),
``virtual_stages`` stages round-robin (interleaved 1F1B) or two in a V (ZBV: rank r holds
stages r and 2*pp-1-r, so the first and last stage share rank 0).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from pretrain import torch_compat
from pretrain.config.schema import ConfigError
from pretrain.model.gpt import GPT
from pretrain.model.moe import uncounted
from pretrain.parallel.layout import Layout
from pretrain.parallel.stages import stage_indices, stage_layers

log = logging.getLogger("pretrain")


class _MadeOnUse(dict):
    """chunk -> receive infos, made (buffers allocated) the first time a chunk is used."""

    def __init__(self, make: Callable[[], tuple]):
        super().__init__()
        self.make = make

    def __missing__(self, chunk: int) -> tuple:
        value = self[chunk] = self.make()
        return value


class UncountedStage(PipelineStage):
    """torch's ``PipelineStage``, its shape-inference forward kept out of MoE counts.

    torch runs each stage once on stand-in inputs (the first step) to learn its output
    shapes: a forward in train mode that is not a training step, which an MoE layer must
    not count (moe.uncounted). torch 2.13 calls that forward ``_forward_metadata_inference``,
    2.11 ``_shape_inference``; a torch calls only its own, so both are wrapped here."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):
        with uncounted(self.submod):
            return super()._shape_inference(*args, **kwargs)


class BoundedStage(UncountedStage):
    """torch's ``PipelineStage`` holding receive buffers for the microbatches in flight only.

    torch 2.13 allocates, up front, an activation buffer (non-first stages) and a gradient
    buffer (non-last stages) for every microbatch of the step and keeps them all: at the
    280-512 microbatches of the large published layouts that is tens of GiB. Megatron-LM
    holds buffers only for the microbatches in flight. Here a chunk's buffers are made when
    its receive is posted and dropped after its backward (autograd keeps whatever it saved
    of them), so at most the schedule's in-flight count exists (planning/memory.py counts
    that). Everything else is torch's own. The hooks overridden are torch 2.13's private
    ones (torch_compat: ``stage_forward_recv_hook``, ``stage_backward_recv_hook``):
    ``stage_class`` uses this class only on a torch that has them."""

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        if self.is_first:
            return super()._setup_forward_recv_info(num_microbatches, has_backward)
        recv_info = torch_compat.private("RecvInfo")
        make_tensor = torch_compat.private("make_tensor_from_meta")
        metas, source = self._stage_meta.inputs, self.stage_index - 1
        name = f"recv_for_{self.stage_index}_from_{source}"
        self.args_recv_info = _MadeOnUse(lambda: tuple(
            recv_info(input_name=name, source=source, tensor_meta=meta,
                      buffer=make_tensor(meta, self.device))
            for meta in metas))

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        self.chunks = num_microbatches
        self.grad_recv_info = _MadeOnUse(lambda: self._create_grad_recv_info(self.act_send_info))

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not (self.has_backward and torch.is_grad_enabled()) and not self.is_first:
            self.args_recv_info.pop(fwd_chunk_id, None)  # evaluation: no backward to wait for
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.grad_recv_info.pop(bwd_chunk_id, None)
        if not self.is_first:
            self.args_recv_info.pop(bwd_chunk_id, None)
        return out


_BOUNDED_NEEDS = ("stage_forward_recv_hook", "stage_backward_recv_hook", "RecvInfo",
                  "make_tensor_from_meta")


def stage_class() -> type[PipelineStage]:
    """``BoundedStage`` on the torch its hooks were written for (2.13), else torch's own
    stage (``UncountedStage``), with a warning: it holds receive buffers for every
    microbatch of the step, which planning/memory.py does not count."""
    missing = [k for k in _BOUNDED_NEEDS
               if not (torch_compat.has(k) and torch_compat.written_for(k))]
    if not missing:
        return BoundedStage
    log.warning("torch %s: pipeline stages are torch's own PipelineStage, which holds receive "
                "buffers for every microbatch of a step, not only those in flight (more memory "
                "than the plan says at many microbatches): BoundedStage's private torch hooks "
                "(%s) are torch %s's; tested: torch %s", torch.__version__,
                ", ".join(torch_compat.PRIVATE[k].where[0] for k in missing),
                torch_compat.PRIVATE["stage_forward_recv_hook"].written_for[0],
                " and ".join(torch_compat.TESTED))
    if not torch_compat.has("stage_shape_inference"):
        log.warning("torch %s: %s", torch.__version__,
                    torch_compat.missing_reason("stage_shape_inference"))
    return UncountedStage

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}


def split_stage(model: GPT, stage: int, n_stages: int) -> GPT:
    """A copy of ``model`` (on the meta device: copying costs nothing) keeping only what
    stage ``stage`` of ``n_stages`` runs."""
    keep = {str(i) for i in stage_layers(len(model.layers), stage, n_stages)}
    part = copy.deepcopy(model)
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    if stage != 0:
        part.tok_emb = None
        part.pos_emb = None
    if stage != n_stages - 1:
        part.norm = None
        part.lm_head = None
    return part


def split_model(model: GPT, layout: Layout, pp_rank: int) -> tuple[list[int], list[GPT]]:
    ids = stage_indices(layout, pp_rank)
    return ids, [split_stage(model, s, layout.n_stages) for s in ids]


def check_schedule_runs_here(layout: Layout, device_type: str) -> None:
    """ZBV on gloo (the CPU) needs torch 2.13: torch 2.11's schedules warm each stage's
    neighbour links up with a send and a receive, to the rank itself where the V turns (its
    two stages are neighbours), and gloo cannot send to its own rank ("Pair is not
    connected"); torch 2.13's warm-up skips that link. NCCL can."""
    if (layout.pp_schedule == "zbv" and device_type == "cpu"
            and not torch_compat.at_least("2.13")):
        raise ConfigError([
            f"parallel.pp_schedule=zbv on the CPU (gloo) needs torch 2.13 or newer; torch "
            f"{torch.__version__} sends a rank a message from itself where the V turns, "
            "which gloo cannot: use parallel.pp_schedule=interleaved_1f1b here, or torch 2.13"])


def build_schedule(
    parts: list[nn.Module], stage_ids: list[int], layout: Layout, pp_mesh: DeviceMesh,
    device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The named schedule over this rank's stages. Gradients are divided by the number of
    microbatches (``scale_grads``), so with a mean loss per microbatch they equal those of
    one mean over the local batch, as without a pipeline."""
    group = pp_mesh.get_group()
    check_schedule_runs_here(layout, pp_mesh.device_type)
    stage = stage_class()
    stages = [stage(part, sid, layout.n_stages, device, group=group)
              for part, sid in zip(parts, stage_ids, strict=True)]
    cls = SCHEDULE_CLASSES[layout.pp_schedule]
    if layout.pp_schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=layout.microbatches, loss_fn=loss_fn,
                   scale_grads=True)
    return cls(stages, n_microbatches=layout.microbatches, loss_fn=loss_fn, scale_grads=True)
