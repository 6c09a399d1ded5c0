"""Every private torch name this project uses, behind one look-up.

torch's private modules and underscore names move or vanish between releases without a
deprecation (2.11 keeps ``_make_tensor_from_meta`` in ``pipelining.stage``, 2.13 in
``pipelining._utils``). So nothing else in the package names one: it asks ``private(key)``
here, which imports the name on first use (never at module import time, so a torch that
lacks it still runs everything that does not need it), warns once when the running torch is
outside the versions the use was written and tested against, and, when the name is gone,
raises ``TorchCompatError`` naming it, the torch found, the tested range and the fix.
tests/test_torch_compat.py deletes every name listed here from torch and runs a training
job; tests/test_architecture.py checks no other module spells a private torch name.

ATen operator overloads (``torch.ops.aten._scaled_dot_product_flash_attention``) are the
dispatcher's names, not Python API: the selective-checkpoint policy lists them as torch's
documentation does, guarded by ``hasattr``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

from pretrain.errors import UserError

log = logging.getLogger("pretrain")

TESTED = ("2.11", "2.13")  # the torch minor versions CI runs the suite on (.ci/run)


class TorchCompatError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Private:
    """One private name: where it lives (``module:attr.attr``; the first that exists wins),
    the torch minors it was written against, what the project uses it for and what to do
    when it is gone."""

    where: tuple[str, ...]
    written_for: tuple[str, str]
    use: str
    fix: str = (f"install a tested torch ({' or '.join(TESTED)}), or port this use to the "
                "torch you have (src/pretrain/torch_compat.py)")
    cuda_build: bool = False  # only a CUDA build of torch has it (the CPU wheel lacks it)


_PIPELINE_FIX = ("none needed: pipeline layouts then run torch's own PipelineStage, which "
                 "holds a receive buffer for every microbatch; install torch 2.13 for "
                 "buffers bounded by the microbatches in flight")
PRIVATE: dict[str, Private] = {
    "make_tensor_from_meta": Private(
        ("torch.distributed.pipelining._utils:_make_tensor_from_meta",
         "torch.distributed.pipelining.stage:_make_tensor_from_meta"),
        ("2.11", "2.13"), "pipeline receive buffers made on use (parallel/pipeline.py)"),
    "RecvInfo": Private(
        ("torch.distributed.pipelining.stage:_RecvInfo",), ("2.13", "2.13"),
        "pipeline receive buffers made on use (parallel/pipeline.py)", _PIPELINE_FIX),
    # The PipelineStage hooks BoundedStage overrides: their names and meaning are torch
    # 2.13's; on any other torch parallel/pipeline.py uses torch's own stage unchanged.
    "stage_forward_recv_hook": Private(
        ("torch.distributed.pipelining:PipelineStage._setup_forward_recv_info",),
        ("2.13", "2.13"), "BoundedStage's forward receive buffers", _PIPELINE_FIX),
    "stage_backward_recv_hook": Private(
        ("torch.distributed.pipelining:PipelineStage._setup_backward_recv_info",),
        ("2.13", "2.13"), "BoundedStage's gradient receive buffers", _PIPELINE_FIX),
    "stage_shape_inference": Private(
        ("torch.distributed.pipelining:PipelineStage._forward_metadata_inference",
         "torch.distributed.pipelining:PipelineStage._shape_inference"),
        ("2.11", "2.13"), "the pipeline's shape-inference forward, not counted by MoE layers",
        "none needed for dense models; with MoE under a pipeline the load counts then "
        "include the one shape-inference forward: install a tested torch"),
    "muon_newton_schulz": Private(
        ("torch.optim._muon:_zeropower_via_newtonschulz",), ("2.11", "2.13"),
        "Muon's orthogonalisation of whole matrices (muon.py)"),
    "muon_adjust_lr": Private(
        ("torch.optim._muon:_adjust_lr",), ("2.11", "2.13"), "Muon's LR by shape (muon.py)"),
    "replicate": Private(
        ("torch.distributed._composable.replicate_with_fsdp:replicate",), ("2.11", "2.13"),
        "DDP as FSDP2-style replicate (parallel/data_parallel.py)"),
    "checkpoint_wrapper": Private(
        ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper",),
        ("2.11", "2.13"), "activation checkpointing per block (parallel/activation_checkpoint.py)"),
    "all_to_all_single_autograd": Private(
        ("torch.distributed._functional_collectives:all_to_all_single_autograd",),
        ("2.11", "2.13"), "expert parallelism's token exchange (parallel/expert_parallel.py)"),
    "wait_tensor": Private(
        ("torch.distributed._functional_collectives:wait_tensor",), ("2.11", "2.13"),
        "expert parallelism's token exchange (parallel/expert_parallel.py)"),
    "AsyncCollectiveTensor": Private(
        ("torch.distributed._functional_collectives:AsyncCollectiveTensor",), ("2.11", "2.13"),
        "expert parallelism's token exchange (parallel/expert_parallel.py)"),
    "FakeTensor": Private(
        ("torch._subclasses.fake_tensor:FakeTensor",), ("2.11", "2.13"),
        "expert counts under the planner's fake tensors (parallel/expert_parallel.py)"),
    "FakeTensorMode": Private(
        ("torch._subclasses.fake_tensor:FakeTensorMode",), ("2.11", "2.13"),
        "tools/plan.py --simulate (planning/simulate.py)"),
    "MemTracker": Private(
        ("torch.distributed._tools.mem_tracker:MemTracker",), ("2.11", "2.13"),
        "tools/plan.py --simulate (planning/simulate.py)"),
    "TorchDispatchMode": Private(
        ("torch.utils._python_dispatch:TorchDispatchMode",), ("2.11", "2.13"),
        "counting the aten ops a step dispatches (planning/dispatch.py)"),
    "disable_current_modes": Private(
        ("torch.utils._python_dispatch:_disable_current_modes",), ("2.11", "2.13"),
        "DTensor's sharding propagation kept out of --simulate's memory tracker"),
    "ShardingPropagator": Private(
        ("torch.distributed.tensor._sharding_prop:ShardingPropagator",), ("2.11", "2.13"),
        "DTensor's sharding propagation kept out of --simulate's memory tracker"),
    "is_traceable_wrapper_subclass": Private(
        ("torch.utils._python_dispatch:is_traceable_wrapper_subclass",), ("2.11", "2.13"),
        "tools/plan.py --simulate (planning/simulate.py)"),
    "FakeStore": Private(
        ("torch.testing._internal.distributed.fake_pg:FakeStore",), ("2.11", "2.13"),
        "the fake process group of tools/plan.py --simulate (planning/simulate.py)"),
    "enable_symm_mem_for_group": Private(
        ("torch.distributed._symmetric_memory:enable_symm_mem_for_group",), ("2.11", "2.13"),
        "parallel.async_tp (parallel/tensor_parallel.py)"),
    "micro_pipeline_tp": Private(
        ("torch._inductor.config:_micro_pipeline_tp",), ("2.11", "2.13"),
        "parallel.async_tp: inductor's micro-pipeline TP pass (parallel/tensor_parallel.py)"),
    "clear_sharding_prop_cache": Private(
        ("torch.distributed.tensor.debug:_clear_sharding_prop_cache",), ("2.11", "2.13"),
        "emptying DTensor's caches after a run (parallel/mesh.py)"),
    "clear_redistribute_planner_cache": Private(
        ("torch.distributed.tensor._redistribute:clear_redistribute_planner_cache",),
        ("2.11", "2.13"), "emptying DTensor's caches after a run (parallel/mesh.py)"),
    "grad_scaler_scale_async": Private(
        ("torch.amp.grad_scaler:GradScaler._get_scale_async",), ("2.11", "2.13"),
        "fp16's loss scale without a host sync (train_module.py)"),
    "grouped_mm": Private(
        ("torch:_grouped_mm",), ("2.11", "2.13"),
        "MoE experts as one grouped GEMM (moe.py)",
        "none needed: MoE experts then run one matmul each (slower, same result)"),
    "cpu_avx512_bf16": Private(
        ("torch.cpu:_is_avx512_bf16_supported",), ("2.11", "2.13"),
        "precision=auto on a CPU (hardware/device.py)",
        "name the precision (precision=bf16 or fp32): precision=auto then takes fp32 here"),
    "cpu_amx_tile": Private(
        ("torch.cpu:_is_amx_tile_supported",), ("2.11", "2.13"),
        "precision=auto on a CPU (hardware/device.py)",
        "name the precision (precision=bf16 or fp32): precision=auto then takes fp32 here"),
    "set_pg_timeout": Private(
        ("torch.distributed.distributed_c10d:_set_pg_timeout",), ("2.11", "2.13"),
        "comm.train_timeout_s after the first step (train/hang.py; torchtitan's way)",
        "none needed: every collective then keeps comm.init_timeout_s"),
    "c10d_world": Private(
        ("torch.distributed.distributed_c10d:_world",), ("2.11", "2.13"),
        "every process group of the run, for comm.train_timeout_s (train/hang.py)",
        "none needed: every collective then keeps comm.init_timeout_s"),
    "c10d_default_store": Private(
        ("torch.distributed.distributed_c10d:_get_default_store",), ("2.11", "2.13"),
        "naming the ranks that did not arrive at a collective that timed out (train/hang.py)"),
    "record_memory_history": Private(
        ("torch.cuda.memory:_record_memory_history",), ("2.11", "2.13"),
        "profile.memory_snapshot (train/services/memory_snapshot.py)"),
    "dump_snapshot": Private(
        ("torch.cuda.memory:_dump_snapshot",), ("2.11", "2.13"),
        "profile.memory_snapshot (train/services/memory_snapshot.py)"),
    "cuda_oom_observer": Private(
        ("torch._C:_cuda_attach_out_of_memory_observer",), ("2.11", "2.13"),
        "a memory snapshot when CUDA runs out of memory (profile.memory_snapshot)",
        "none needed: the snapshots of profile.memory_snapshot_steps are still written",
        cuda_build=True),
    "cpu_amx_fp16": Private(
        ("torch.cpu:_is_amx_fp16_supported",), ("2.11", "2.13"),
        "precision=auto on a CPU (hardware/device.py)",
        "name the precision (precision=fp16 or fp32): precision=auto then takes fp32 here"),
}


def torch_minor() -> str:
    """The running torch's ``major.minor`` (``2.11`` for ``2.11.0+cu130``)."""
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _minor_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def at_least(minor: str) -> bool:
    """Whether the running torch is ``minor`` (``"2.13"``) or newer: for public behaviour
    that changed between the tested versions."""
    return _minor_key(torch_minor()) >= _minor_key(minor)


def written_for(key: str) -> bool:
    """Whether the running torch is within the versions ``key``'s use was written for."""
    lo, hi = PRIVATE[key].written_for
    return _minor_key(lo) <= _minor_key(torch_minor()) <= _minor_key(hi)


def _resolve(where: str) -> object:
    """The object at ``module:attr.attr``; AttributeError or ImportError when it is not
    there."""
    module, _, attrs = where.partition(":")
    obj: object = importlib.import_module(module)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


def _find(key: str) -> object:
    for where in PRIVATE[key].where:
        try:
            return _resolve(where)
        except (ImportError, AttributeError):
            continue
    import torch

    p = PRIVATE[key]
    raise TorchCompatError(
        f"torch {torch.__version__} has no {' or '.join(p.where)} (used for {p.use}); this "
        f"use was written against torch {'-'.join(dict.fromkeys(p.written_for))} and is "
        f"tested on torch {' and '.join(TESTED)}. Fix: {p.fix}")


@functools.cache
def _warn_untested(key: str) -> None:
    import torch

    p = PRIVATE[key]
    log.warning("torch %s is outside the versions %s (%s) was written against (%s; tested: "
                "%s): it is used as found", torch.__version__, p.where[0], p.use,
                "-".join(dict.fromkeys(p.written_for)), ", ".join(TESTED))


def private(key: str) -> object:
    """The private torch object ``key`` names (see ``PRIVATE``), looked up now, so a name
    deleted or moved at run time is seen; TorchCompatError when this torch lacks it."""
    found = _find(key)
    if not written_for(key):
        _warn_untested(key)
    return found


def set_private(key: str, value: object) -> None:
    """Set the private torch setting ``key`` names (a flag of a config module) to ``value``,
    after checking, as ``private`` does, that this torch has it."""
    private(key)
    for where in PRIVATE[key].where:
        module, _, attrs = where.partition(":")
        *path, leaf = attrs.split(".")
        try:
            owner = _resolve(f"{module}:{'.'.join(path)}") if path else (
                importlib.import_module(module))
        except (ImportError, AttributeError):
            continue
        if hasattr(owner, leaf):
            setattr(owner, leaf, value)
            return


def has(key: str) -> bool:
    """Whether this torch has ``key``'s name (for uses with a fallback)."""
    try:
        _find(key)
    except TorchCompatError:
        return False
    return True


def missing_reason(key: str) -> str | None:
    """None when this torch has ``key``'s name, else the TorchCompatError's message."""
    try:
        _find(key)
    except TorchCompatError as e:
        return str(e)
    return None
