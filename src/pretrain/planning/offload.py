"""The step cost of ``parallel.offload=params`` (planning/cost.py adds it to the step):
PCIe copies of the parameter and gradient shards, and the host's optimizer step and
gradient sums, timed on a real host (planning/calibration.py). ``defers_reduction`` (one
gradient reduction a step, or one a micro batch) is here because the copies follow it; the
memory model reads it too."""

from __future__ import annotations

from pretrain.config.schema import Config
from pretrain.hardware.gpus import GpuSpec
from pretrain.parallel.layout import Layout
from pretrain.planning.calibration import HOST_ADAMW_NS, HOST_GRAD_ADD_NS
from pretrain.planning.params import rank_params
from pretrain.precision.policy import dtype_bytes


def defers_reduction(layout: Layout) -> bool:
    """Whether gradients accumulate over the micro batches unreduced (one reduction a step):
    a pipeline (torch's pipelining), or DDP/ZeRO-2 over more than one DP rank (the trainer's
    no-sync, step_strategy.defer_reduction); otherwise each micro batch's backward reduces."""
    return layout.pp > 1 or (layout.dp > 1 and layout.dp_spec.defers_reduction
                             and layout.microbatches > 1)


def offload_bytes(cfg: Config, layout: Layout) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes per step of parallel.offload=params: the
    parameter shard once per all-gather, the gradient shard once per reduce-scatter. FSDP2
    reshards after every backward, so ZeRO-2 gathers once per micro batch, ZeRO-3 twice."""
    if layout.offload != "params":
        return 0.0, 0.0
    local = rank_params(cfg.model, layout).local * dtype_bytes(cfg.precision.param_dtype)
    mb = layout.microbatches
    if layout.pp > 1:
        gathers = mb if layout.dp_spec.reshard_after_forward else 1
    else:
        gathers = 2 * mb if layout.dp_spec.reshard_after_forward else mb
    return gathers * local, offload_reductions(layout) * local


def offload_reductions(layout: Layout) -> int:
    """Gradient shards copied to the host per step (each after the first is summed there)."""
    return 1 if defers_reduction(layout) else layout.microbatches


def host_optimizer(cfg: Config) -> str:
    """The AdamW build_optimizer makes for host parameters: fused only when optim.fused
    says so (its default is fused on CUDA alone), else torch's single-tensor for-loop."""
    return "fused" if cfg.optim.fused else "for_loop"


def offload_seconds(cfg: Config, layout: Layout, gpu: GpuSpec) -> float:
    """PCIe copies at the GPU type's ``pcie_gbps``, then the host's work, timed on a real
    host (planning/calibration.py): the AdamW step over the rank's parameters and, for each
    gradient shard copied back after the first, its sum into the host gradient."""
    h2d, d2h = offload_bytes(cfg, layout)
    if not h2d:
        return 0.0
    params = rank_params(cfg.model, layout).local
    host = params * (HOST_ADAMW_NS[host_optimizer(cfg)]
                     + (offload_reductions(layout) - 1) * HOST_GRAD_ADD_NS) * 1e-9
    host /= gpu.host_speed
    return (h2d + d2h) / (gpu.pcie_gbps * 1e9) + host
