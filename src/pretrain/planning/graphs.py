"""CUDA graphs for one device's step (``train.cuda_graphs``): whether, and what they save.

A small model's step on one GPU is bound by the host: each aten op the eager step dispatches
is a kernel launch costing the host microseconds (planning/dispatch.py, calibration.py),
far more than the kernel's own time. modded-nanogpt and torchtitan's small runs remove it
the way torch offers: the forward, loss and backward compiled as one graph
(``torch.compile(mode="reduce-overhead")``: inductor's kernels captured into a CUDA graph
by cudagraph trees, replayed with one launch per micro batch, inputs copied into static
buffers), the optimizer step outside the graph (fused AdamW: a handful of launches).

``train.cuda_graphs``: ``false``; ``true`` (one device on CUDA, else an error naming the
key); ``auto``: on where the planner says this run's step on one CUDA device is host-bound
(``graph_verdict``). What breaks a graph is kept out of the captured region: shapes are
static (``dynamic=False``, the same micro batch every step; an evaluation batch compiles a
graph of its own), the region makes no host sync (tests/test_cuda_graphs.py checks that no
``aten._local_scalar_dense`` or data-dependent op runs in it), and the loss is read on
logging steps only, outside it (tests/test_loop_syncs.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pretrain.budget.compute import Budget
from pretrain.config.schema import Config
from pretrain.hardware.gpus import GpuSpec
from pretrain.parallel.layout import Layout
from pretrain.planning.cost import step_cost
from pretrain.planning.dispatch import count_ops, loss_chunks
from pretrain.planning.host import outside_ops, outside_seconds

SETTINGS = ("auto", "true", "false")
# The host's cost of one graph replay (cudaGraphLaunch) and of copying a micro batch's
# tokens and targets into the graph's static inputs: a stated figure of the order of a few
# launches, not measured here (it waits for a GPU: docs/benchmarks.md).
GRAPH_REPLAY_S = 30e-6


@dataclass(frozen=True)
class GraphVerdict:
    """One device's step, eager and as a replayed graph, in the planner's model."""

    region_ops: int  # aten ops dispatched by one micro batch's forward, loss and backward
    step_ops: int  # all of a step's: micro batches, clipping, the optimizer step
    host_s: float  # the step's host time as configured
    device_s: float  # the GPU's time as configured
    graphed_host_s: float  # with the region replayed as a graph
    graphed_device_s: float  # the compiled kernels' time
    host_bound: bool

    @property
    def step_s(self) -> float:
        return max(self.host_s, self.device_s)

    @property
    def graphed_step_s(self) -> float:
        return max(self.graphed_host_s, self.graphed_device_s)

    def line(self) -> str:
        verdict = "HOST-BOUND" if self.host_bound else "not host-bound"
        return (f"one device: {verdict} ({self.step_ops:,} dispatched ops a step, "
                f"{self.region_ops:,} in each micro batch's forward, loss and backward; host "
                f"{self.host_s:.3g} s, GPU {self.device_s:.3g} s). As a CUDA graph "
                f"(train.cuda_graphs): host {self.graphed_host_s:.3g} s, GPU "
                f"{self.graphed_device_s:.3g} s, {self.step_s / self.graphed_step_s:.1f}x "
                "the step's speed (planned, not measured)")


def graph_verdict(cfg: Config, layout: Layout, gpu: GpuSpec, budget: Budget) -> GraphVerdict:
    """The planner's host-bound verdict for this one-device run and its graphed step."""
    m, mb = cfg.model, layout.microbatches
    c = count_ops(m)
    chunks = loss_chunks(m, layout.micro_batch_size)
    region = c.outside + m.n_layer * c.per_block + c.loss_base + c.loss_per_chunk * chunks
    cost = step_cost(cfg, layout, gpu, budget)
    compiled = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True))
    graphed = step_cost(compiled, layout, gpu, budget)
    return GraphVerdict(
        region_ops=region, step_ops=mb * region + sum(outside_ops(cfg, layout).values()),
        host_s=cost.host, device_s=cost.device,
        graphed_host_s=mb * GRAPH_REPLAY_S + outside_seconds(cfg, layout),
        graphed_device_s=graphed.device, host_bound=cost.host_bound)


def use_cuda_graphs(cfg: Config, layout: Layout, device_type: str,
                    host_bound: bool | None = None) -> bool:
    """Whether this run replays its step as a CUDA graph: ``train.cuda_graphs`` resolved.
    ``auto`` needs ``host_bound``, the planner's verdict (``graph_verdict``)."""
    setting = str(cfg.train.cuda_graphs).lower()
    if setting not in SETTINGS:
        raise ValueError(f"train.cuda_graphs={cfg.train.cuda_graphs!r}: one of "
                         f"{', '.join(SETTINGS)}")
    possible = layout.one_device and device_type == "cuda"
    if setting == "true" and not possible:
        raise ValueError(
            "train.cuda_graphs=true replays one device's step as a CUDA graph: it needs "
            f"train.device=cuda and one process without offload (this run: {device_type}, "
            f"{layout.describe()}); set train.cuda_graphs=auto or false")
    if setting == "auto":
        return possible and bool(host_bound)
    return setting == "true"


def decide_cuda_graphs(cfg: Config, layout: Layout, device_type: str) -> bool:
    """``train.cuda_graphs`` for the run being built: under ``auto`` the planner's verdict on
    this CUDA device's type (hardware/gpus.local_gpu)."""
    host_bound = None
    auto = str(cfg.train.cuda_graphs).lower() == "auto"
    if auto and layout.one_device and device_type == "cuda":
        from pretrain.budget.compute import resolve_budget
        from pretrain.hardware.gpus import local_gpu

        budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
        host_bound = graph_verdict(cfg, layout, local_gpu("cuda"), budget).host_bound
    return use_cuda_graphs(cfg, layout, device_type, host_bound)
