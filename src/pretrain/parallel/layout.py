"""The resolved parallel layout: how many processes do what, derived once from the config.

``parallel`` in a recipe declares tp, pp and (optionally) dp; the world size comes from the
launcher (``WORLD_SIZE``, set by torchrun/srun). Everything else the run needs (DP
replicate x shard split, microbatches per step, stages per rank) follows from those and the
global batch, and is computed here so that validation, the plan and the trainer agree.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from pretrain.config.schema import Config, ParallelConfig, PipelineSchedule
from pretrain.parallel.dp_modes import DpModeSpec, dp_mode

# Schedules that hold several stages per rank ("virtual" stages); the others hold one.
MULTI_STAGE_SCHEDULES = (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zbv)


def world_size_from_env() -> int:
    """The number of processes the launcher started (1 when not launched by one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def model_parallel_size(par: ParallelConfig) -> int:
    """tp * pp: the processes one model replica spans. The world size is this times dp."""
    return max(par.tp, 1) * max(par.pp, 1)


def layout_world_size(par: ParallelConfig) -> int:
    """The processes a layout declares: tp * pp * dp as written (dp=1 when left out). The
    plan's default GPU count and the dry run's world size are this number."""
    return model_parallel_size(par) * max(par.dp or 1, 1)


def declared_world_size(cfg: Config) -> int:
    """The world size a run has: WORLD_SIZE when launched, else the layout's own
    (``layout_world_size``), so a dry run checks a multi-process recipe in one process."""
    if "WORLD_SIZE" in os.environ:
        return world_size_from_env()
    return layout_world_size(cfg.parallel)


def derived_dp(cfg: Config, world_size: int) -> int:
    par = cfg.parallel
    return par.dp if par.dp is not None else world_size // model_parallel_size(par)


@dataclass(frozen=True)
class Layout:
    """A validated layout. ``microbatches`` is per DP rank and step: the gradient
    accumulation count without PP, the pipeline's microbatch count with it."""

    tp: int
    pp: int
    dp: int
    dp_replicate: int
    dp_shard: int
    dp_mode: str
    pp_schedule: str
    virtual_stages: int
    micro_batch_size: int
    microbatches: int
    sequence_parallel: bool
    activation_checkpointing: str
    ep: int = 1  # expert-parallel ranks, within dp_shard (ep x dp_shard/ep = dp_shard)
    offload: str = "none"  # params: parameter shards, gradients, optimizer state on the host
    async_tp: bool = False  # TP collectives micro-pipelined with the matmuls (CUDA, compiled)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def one_device(self) -> bool:
        """One process with everything on its device: no process group, no wrapper
        (train_module.join, parallel/data_parallel.needs_wrapper), autocast under mixed
        precision, and compile takes the model and its loss as one graph (apply.py)."""
        return self.world_size == 1 and self.offload == "none"

    def compile_scope(self) -> str:
        """What ``train.compile`` compiles on this layout (parallel/apply.py's rule)."""
        if self.one_device:
            return "model + loss, one graph"
        return "per block, loss" if self.tp == 1 else "per block"

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def local_batch_size(self) -> int:
        """Sequences one DP rank processes per optimizer step."""
        return self.micro_batch_size * self.microbatches

    @property
    def dp_spec(self) -> DpModeSpec:
        """``dp_mode``'s spec (parallel/dp_modes.py)."""
        return dp_mode(self.dp_mode)

    @property
    def hsdp(self) -> bool:
        return self.dp_spec.shards and self.dp_replicate > 1

    def as_dict(self) -> dict:
        return {**asdict(self), "world_size": self.world_size,
                # the name the single-device plan used for the accumulation count
                "grad_accum": self.microbatches}

    def describe(self) -> str:
        if self.one_device:
            text = (
                f"one device, no wrapper, micro batch {self.micro_batch_size} x {self.microbatches}"
            )
            if self.activation_checkpointing != "none":
                text += f", {self.activation_checkpointing} activation checkpointing"
            return text
        dp = f"dp={self.dp} ({self.dp_mode}"
        dp += f", {self.dp_replicate} replicas x {self.dp_shard} shards)" if self.hsdp else ")"
        if self.ep > 1:
            dp += f" with ep={self.ep} (experts over {self.ep} of its ranks)"
        if self.offload != "none":
            dp += ", parameters, gradients and optimizer state offloaded to host memory"
        tp = f"tp={self.tp}{' +SP' if self.sequence_parallel else ''}"
        text = f"{tp}{' (async)' if self.async_tp else ''} x pp={self.pp} x {dp}"
        if self.pp > 1:
            text += f", {self.pp_schedule} over {self.n_stages} stages"
        text += f", micro batch {self.micro_batch_size} x {self.microbatches}"
        if self.activation_checkpointing != "none":
            text += f", {self.activation_checkpointing} activation checkpointing"
        return text


def resolve_layout(cfg: Config, world_size: int) -> Layout:
    """The layout of a config that decision/checks.py's ``check`` accepted for ``world_size``."""
    par = cfg.parallel
    dp = derived_dp(cfg, world_size)
    if not dp_mode(par.dp_mode).shards:
        replicate, shard = dp, 1
    else:
        replicate = max(par.dp_replicate, 1)
        shard = par.dp_shard if par.dp_shard is not None else dp // replicate
    return Layout(
        tp=par.tp, pp=par.pp, dp=dp, dp_replicate=replicate, dp_shard=shard,
        dp_mode=par.dp_mode, pp_schedule=par.pp_schedule,
        virtual_stages=par.virtual_stages if par.pp > 1 else 1,
        micro_batch_size=par.micro_batch_size,
        microbatches=cfg.train.global_batch_size // (par.micro_batch_size * dp),
        sequence_parallel=par.sequence_parallel,
        activation_checkpointing=par.activation_checkpointing, ep=par.ep,
        offload=str(par.offload), async_tp=par.async_tp,
    )
