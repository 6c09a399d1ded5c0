"""One spec per data-parallel mode (``parallel.dp_mode``): what it shards, which torch call
applies it, and when it gathers and reduces. The wrapper (data_parallel.py), the layout
rules, the memory and cost planner and the step strategy read these fields; no module
outside this one and the config schema compares a mode's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DpModeSpec:
    """``shards``: FSDP2's ``fully_shard`` over dp_shard ranks (parameters, gradients and
    optimizer state sharded; HSDP replicas and host offload possible), else the composable
    ``replicate`` (DDP: whole tensors on every rank, gradients all-reduced).
    ``reshard_after_forward``: the parameters are freed after each forward and gathered
    again for the backward (ZeRO-3), else kept gathered until the step (ZeRO-2).
    ``defers_reduction``: over several micro batches the gradients accumulate unreduced and
    are reduced once a step (the trainer's no-sync), else every backward reduce-scatters."""

    name: str
    shards: bool
    reshard_after_forward: bool
    defers_reduction: bool
    what: str


DP_MODES: dict[str, DpModeSpec] = {s.name: s for s in (
    DpModeSpec("ddp", shards=False, reshard_after_forward=False, defers_reduction=True,
               what="replicate: whole parameters, gradients and optimizer state per rank"),
    DpModeSpec("zero2", shards=True, reshard_after_forward=False, defers_reduction=True,
               what="fully_shard(reshard_after_forward=False): gradients and optimizer state "
                    "sharded, parameters gathered once a step"),
    DpModeSpec("zero3", shards=True, reshard_after_forward=True, defers_reduction=False,
               what="fully_shard: parameters, gradients and optimizer state sharded, "
                    "parameters gathered for each forward and backward"),
)}
# The sharded modes, and the one that holds the least per rank (the planner's suggestions).
SHARDED = tuple(n for n, s in DP_MODES.items() if s.shards)
LEAST_MEMORY = next(n for n, s in DP_MODES.items() if s.shards and s.reshard_after_forward)
GATHER_ONCE = next(n for n, s in DP_MODES.items() if s.shards and not s.reshard_after_forward)


def dp_mode(name: str) -> DpModeSpec:
    """``parallel.dp_mode``'s spec (the schema's DpMode enum refuses other names)."""
    return DP_MODES[name]
