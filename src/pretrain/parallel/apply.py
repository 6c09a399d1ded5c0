"""Turn a meta-device GPT into this rank's share of the model, in the order that composes:

fp8 conversion -> pipeline split -> tensor (+ sequence) parallel -> activation checkpointing
-> compile (per block, fullgraph) -> FSDP2 / replicate, all on the meta device (no memory), then
materialise: allocate the local shards and initialise them (each rank draws only its own
shards' values, which are those of the same elements in one process: see initialization.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from pretrain.config import Config
from pretrain.model import GPT, set_attention_backend
from pretrain.parallel.activation_checkpoint import apply_activation_checkpointing
from pretrain.parallel.data_parallel import apply_data_parallel, needs_wrapper
from pretrain.parallel.layout import Layout
from pretrain.parallel.mesh import Meshes
from pretrain.parallel.pipeline import build_schedule, split_model
from pretrain.parallel.tensor_parallel import apply_tensor_parallel
from pretrain.parallel.tied import TiedEmbedding, tied_embedding
from pretrain.precision import Policy


@dataclass
class ParallelModel:
    """This rank's model chunks and how to drive them.

    ``parts`` is one GPT without pipeline parallelism, else this rank's pipeline stages
    (``stage_ids``), run by ``schedule``."""

    parts: list[nn.Module]
    stage_ids: list[int] = field(default_factory=lambda: [0])
    n_stages: int = 1
    schedule: object | None = None
    tied: TiedEmbedding | None = None

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for part in self.parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    @property
    def duplicate_params(self) -> frozenset[int]:
        return self.tied.duplicates if self.tied is not None else frozenset()

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)


def parallelize(model: GPT, cfg: Config, layout: Layout, mesh: Meshes | None,
                device: torch.device, policy: Policy,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> ParallelModel:
    """Apply every parallelism to ``model`` (on the meta device); nothing is allocated."""
    sharded = mesh is not None and layout.dp > 1 and layout.dp_mode in ("zero2", "zero3")
    if policy.fp8:
        from pretrain.fp8 import convert_to_fp8

        convert_to_fp8(model, policy.fp8_recipe, policy.fp8_filter, emulate=policy.fp8_emulate,
                       fsdp_all_gather=sharded)
    # Tensorwise fp8 under TP: torchao's Float8 styles (activations gathered in fp8). With
    # sequence parallelism they put an fp8 tensor through a collective gloo rejects
    # ("RuntimeError: Invalid scalar type", torch 2.13), so on CPU that case gathers in bf16.
    fp8_tp = policy.fp8 and policy.fp8_recipe == "tensorwise" and (
        device.type == "cuda" or not layout.sequence_parallel)
    stage_ids, parts = [0], [model]
    if mesh is not None and layout.pp > 1:
        stage_ids, parts = split_model(model, layout, mesh.pp.get_local_rank())
    for part in parts:
        if mesh is not None and layout.tp > 1:
            apply_tensor_parallel(part, mesh.tp, layout.sequence_parallel, fp8_tensorwise=fp8_tp)
        # Checkpointing, then compile (torchtitan's order): each block compiles as one
        # graph with its checkpoint region inside (fullgraph=True: a graph break is an
        # error, not a silent slowdown), the selective policy applied by the partitioner.
        apply_activation_checkpointing(part.layers, layout.activation_checkpointing,
                                       cfg.parallel.ac_every_n_layers)
        if cfg.train.compile:  # regional: each block once, the same code for all of them
            for block in part.layers.values():
                block.compile(fullgraph=True)
        if mesh is not None and needs_wrapper(layout, policy.mixed):
            apply_data_parallel(part, list(part.layers.values()), mesh, layout, policy)
    pm = ParallelModel(parts=parts, stage_ids=stage_ids, n_stages=layout.n_stages)
    if mesh is not None:
        pm.tied = tied_embedding(cfg.model.tie_embeddings, parts, stage_ids, layout, mesh.root)
    if mesh is not None and layout.pp > 1:
        pm.schedule = build_schedule(parts, stage_ids, layout, mesh.pp, device, loss_fn)
    return pm


def parallelize_gpt(cfg: Config, layout: Layout, mesh: Meshes | None, device: torch.device,
                    policy: Policy, attention: str,
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                    ) -> ParallelModel:
    """This rank's share of ``cfg.model`` (attention kernel ``attention``), built on the
    meta device and parallelised: nothing allocated yet (see ``materialize``)."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    set_attention_backend(model, attention, device)
    return parallelize(model, cfg, layout, mesh, device, policy, loss_fn)


@torch.no_grad()
def materialize(pm: ParallelModel, device: torch.device, seed: int | None) -> None:
    """Allocate this rank's shards on ``device`` and initialise them from ``seed``.

    Each rank draws only the values of its own shards (``GPT.init_weights``: a pure
    function of seed, name and global shape), so start-up memory is O(shard) and every
    layout starts from the weights one process would. ``seed`` None allocates without
    initialising, for a run about to load a checkpoint over them.
    """
    for part in pm.parts:
        part.to_empty(device=device)
        part.tie_weights()
        if seed is not None:
            part.init_weights(seed)
        elif part.rope is not None:  # not in a checkpoint: computed, never learned
            part.init_rope()
