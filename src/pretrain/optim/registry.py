"""What an optimizer is (``OptimizerSpec``) and where it registers itself.

Each optimizer is one module of ``pretrain/optim/optimizers/`` holding its builder, its state
count and its spec, and ending in ``register(OptimizerSpec(...))``; ``optim/specs.py``
imports every module of that package and so holds them all (``specs.OPTIMIZERS``). A new
optimizer is one file there, its ``conf/optim/<name>.yaml`` and its test
(docs/adding-an-optimizer.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from pretrain.config.schema import OptimConfig

# build(model, cfg, lr, device, also_embeddings) -> the optimizer
Build = Callable[[torch.nn.Module, OptimConfig, float, torch.device, list], torch.optim.Optimizer]
# state_bytes(name, shape, local_shape, pb): bytes of state for the parameter ``name`` of
# global ``shape`` of which this rank holds ``local_shape``, parameters ``pb`` bytes each
StateBytes = Callable[[str, tuple[int, ...], tuple[int, ...], int], int]
ANY_RULE = frozenset({"fixed", "deepseek", "power"})
ANY_SCALING = frozenset({"none", "sqrt", "linear"})
# The optim.* keys that mean the same under every optimizer: the LR and its rules, clipping,
# the spike guard (read by the loop and the decision step, not by a builder). Every other
# key of OptimConfig is read by the optimizers whose spec lists it in ``reads``.
SHARED_KEYS = frozenset({
    "name", "lr", "ref_batch_tokens", "lr_scaling", "lr_rule", "lr_law", "grad_clip",
    "allow_lr_out_of_range", "spike_guard", "spike_sigmas", "spike_window", "spike_warmup"})


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer. ``reads``: the optim.* keys its builder reads beyond SHARED_KEYS (a
    key it does not read and the user changed is a warning: decision/checks.py);
    ``lr_rules``/``lr_scalings``: the optim.lr_rule and optim.lr_scaling values that keep
    their meaning with it (``why``: the reason the others do not); ``lr_range``: the peak
    LRs it usually trains with (outside, the plan warns); ``elementwise``: its step reads
    each element alone (no whole-tensor norm, gather or factored reduction), so FSDP2 may
    run it on host shards; ``mup``: it has a muP/CompleteP rule
    (model/parametrization.py's groups); ``orthogonalises``: its step gathers and
    orthogonalises whole matrices (Muon: the planner's step transient); ``on_dtensor``: its
    step runs on DTensor parameters (FSDP2's and TP's shards), else the layout rules keep it
    to whole tensors (one process, or DDP's replicas). ``ramp_lr``: how its LR follows the
    batch while batch_ramp changes it (budget/batch_ramp.py): sqrt (the Adam family,
    Malladi et al. 2022; LAMB, You et al. 2020; Muon, whose updates carry AdamW's RMS) or
    linear (SGD and LARS, Goyal et al. 2017)."""

    name: str
    build: Build
    state_bytes: StateBytes
    lr_range: tuple[float, float]
    reads: frozenset[str] = frozenset()
    lr_rules: frozenset[str] = ANY_RULE
    lr_scalings: frozenset[str] = ANY_SCALING
    why: str = ""
    elementwise: bool = False
    mup: bool = False
    orthogonalises: bool = False
    on_dtensor: bool = True
    ramp_lr: str = "sqrt"


_SPECS: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add ``spec`` under ``spec.name`` (its module calls this where it defines it). A name
    taken twice, or a ``reads`` key that OptimConfig lacks or every optimizer reads, is a
    ValueError at import."""
    keys = {f.name for f in fields(OptimConfig)}
    if spec.name in _SPECS:
        raise ValueError(f"optimizer {spec.name!r} is registered twice")
    if bad := sorted((spec.reads - keys) | (spec.reads & SHARED_KEYS)):
        raise ValueError(f"optimizer {spec.name!r} reads {bad}: not optimizer-specific keys "
                         "of OptimConfig (src/pretrain/config/schema.py)")
    _SPECS[spec.name] = spec
    return spec


def registered() -> dict[str, OptimizerSpec]:
    """Every spec registered so far, by name, in the order they registered."""
    return dict(_SPECS)
