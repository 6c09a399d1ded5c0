"""The host's work in a step outside the forward/backward region: what a CUDA graph of that
region (``train.cuda_graphs``) cannot remove, and what an eager or compiled step dispatches
besides its model and loss.

Counted per step (a CPU profile of the trainer's step, ``torch.profiler`` over
``Trainer.train_step_local``, ``+recipe=tiny train.compile=true optim.fused=true``: 182 aten
ops outside the compiled region, docs/benchmarks.md):

- ``AccumulateGrad``: autograd's node that puts each parameter's gradient into ``.grad``, one
  per parameter tensor and micro batch (68 a micro batch for the 4-layer tiny model);
- clipping's per-tensor ``.to``: ``clip_grad_norm_`` moves each gradient's norm to one device
  (a no-op on one device, dispatched all the same);
- clipping's and the optimizer's own ops (``dispatch.count_ops``' ``step``: the foreach norms,
  fused AdamW);
- the step's bookkeeping (``BOOKKEEPING_OPS``: the loss's sum, the non-finite check, the
  schedule's update);

each at the host's cost of a dispatched op (``calibration.HOST_S_PER_OP``), and then the
loop's own Python around them (``calibration.HOST_S_LOOP``), which no op count sees.
"""

from __future__ import annotations

from pretrain.config.schema import Config
from pretrain.parallel.layout import Layout
from pretrain.planning.calibration import (
    BOOKKEEPING_OPS,
    COMPILED_LAUNCHES_OUTSIDE,
    COMPILED_LAUNCHES_PER_HEAVY_OP,
    GPU_HOST,
    HostCosts,
)
from pretrain.planning.dispatch import count_ops
from pretrain.planning.params import rank_params


def outside_ops(cfg: Config, layout: Layout) -> dict[str, int]:
    """aten ops (and autograd nodes) a step dispatches outside the forward/backward region
    of this rank, by kind."""
    tensors = len(rank_params(cfg.model, layout).held)
    return {"AccumulateGrad": layout.microbatches * tensors, "clipping's .to": tensors,
            "clipping and the optimizer": count_ops(cfg.model).step,
            "bookkeeping": BOOKKEEPING_OPS}


def outside_seconds(cfg: Config, layout: Layout, costs: HostCosts = GPU_HOST) -> float:
    """The host's time for ``outside_ops`` and the loop's Python, per step: each op at
    ``costs.per_op``, clipping's per-tensor share at ``costs.per_tensor``."""
    ops = outside_ops(cfg, layout)
    tensors = ops.pop("clipping's .to")
    return sum(ops.values()) * costs.per_op + tensors * costs.per_tensor + costs.loop


def graph_calls(cfg: Config, layout: Layout) -> tuple[float, int]:
    """(kernel launches, inputs) of one compiled graph of model and loss (one process):
    inductor's kernels for this rank's blocks and the rest (``calibration.
    COMPILED_LAUNCHES_*``), and the graph's inputs, each parameter tensor and the batch's
    two (what dynamo guards and AOTAutograd's wrappers handle, ``HostCosts.per_input``)."""
    heavy = count_ops(cfg.model).heavy_per_block
    blocks = cfg.model.n_layer // layout.pp
    launches = COMPILED_LAUNCHES_PER_HEAVY_OP * blocks * heavy + COMPILED_LAUNCHES_OUTSIDE
    return launches, len(rank_params(cfg.model, layout).held) + 2
