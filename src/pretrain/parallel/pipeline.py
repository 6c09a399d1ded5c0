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
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.stage import _RecvInfo

from pretrain.model import GPT
from pretrain.moe import uncounted
from pretrain.parallel.layout import Layout


class _MadeOnUse(dict):
    """chunk -> receive infos, made (buffers allocated) the first time a chunk is used."""

    def __init__(self, make: Callable[[], tuple]):
        super().__init__()
        self.make = make

    def __missing__(self, chunk: int) -> tuple:
        value = self[chunk] = self.make()
        return value


class BoundedStage(PipelineStage):
    """torch's ``PipelineStage`` holding receive buffers for the microbatches in flight only.

    torch 2.13 allocates, up front, an activation buffer (non-first stages) and a gradient
    buffer (non-last stages) for every microbatch of the step and keeps them all: at the
    280-512 microbatches of the large published layouts that is tens of GiB. Megatron-LM
    holds buffers only for the microbatches in flight. Here a chunk's buffers are made when
    its receive is posted and dropped after its backward (autograd keeps whatever it saved
    of them), so at most the schedule's in-flight count exists (planning/memory.py counts
    that). Everything else is torch's own."""

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        if self.is_first:
            return super()._setup_forward_recv_info(num_microbatches, has_backward)
        metas, source = self._stage_meta.inputs, self.stage_index - 1
        name = f"recv_for_{self.stage_index}_from_{source}"
        self.args_recv_info = _MadeOnUse(lambda: tuple(
            _RecvInfo(input_name=name, source=source, tensor_meta=meta,
                      buffer=_make_tensor_from_meta(meta, self.device))
            for meta in metas))

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        self.chunks = num_microbatches
        self.grad_recv_info = _MadeOnUse(lambda: self._create_grad_recv_info(self.act_send_info))

    def _forward_metadata_inference(self, *args, **kwargs):
        # torch runs the stage once on stand-in inputs (the first step) to learn its output
        # shapes: a forward in train mode that is not a training step, which an MoE layer
        # must not count (moe.uncounted).
        with uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

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

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}


def stage_indices(layout: Layout, pp_rank: int) -> list[int]:
    """The global stage indices this pipeline rank runs, in execution order (stage 0, the
    whole model, without a pipeline). The planner (planning/params.py, planning/memory.py)
    and the tied-embedding group (tied.py) read this too."""
    if layout.pp == 1:
        return [0]
    if layout.pp_schedule == "zbv":
        return [pp_rank, 2 * layout.pp - 1 - pp_rank]
    return [pp_rank + v * layout.pp for v in range(layout.virtual_stages)]


def stage_layers(n_layer: int, stage: int, n_stages: int) -> range:
    """The global indices of the transformer blocks stage ``stage`` of ``n_stages`` runs
    (balanced by count; validation requires n_layer % n_stages == 0). Stage 0 also holds
    the embeddings, the last stage the final norm and the head (``split_stage``). The
    planner counts parameters and activations per stage with this same function."""
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


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


def build_schedule(
    parts: list[nn.Module], stage_ids: list[int], layout: Layout, pp_mesh: DeviceMesh,
    device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The named schedule over this rank's stages. Gradients are divided by the number of
    microbatches (``scale_grads``), so with a mean loss per microbatch they equal those of
    one mean over the local batch, as without a pipeline."""
    group = pp_mesh.get_group()
    stages = [BoundedStage(part, sid, layout.n_stages, device, group=group)
              for part, sid in zip(parts, stage_ids, strict=True)]
    cls = SCHEDULE_CLASSES[layout.pp_schedule]
    if layout.pp_schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=layout.microbatches, loss_fn=loss_fn,
                   scale_grads=True)
    return cls(stages, n_microbatches=layout.microbatches, loss_fn=loss_fn, scale_grads=True)
