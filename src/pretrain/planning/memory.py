"""Per-GPU memory of a config under a layout, by part, as this repository's code holds it.

Parts (bytes per GPU, for the pipeline rank that needs the most):

- parameters, gradients, optimizer state: exact local shard sizes (``params.py``; measured
  equal on CPU, tests/test_estimate.py). Gradients and the optimizer's state take the
  parameter dtype (``optimizer_state_bytes``: the optimizer spec's ``state_bytes`` of each
  tensor's shard, optim/specs.py): AdamW and LAMB two moments and a 4-byte step counter per
  tensor, LARS one momentum, Muon one momentum for its matrices and AdamW's two moments and
  counter for the rest.
- optimizer step transient: Muon orthogonalises one whole matrix at a time; under FSDP or
  TP its update is first gathered (``muon.orthogonalisation_bytes``: the largest Muon
  matrix of the rank, gathered in the parameter dtype, and Newton-Schulz's working set
  in ``optim.muon_ns_dtype``), after its Nesterov update was made in a shard-sized
  tensor. Fused AdamW (what a GPU builds) has none; the single-tensor LAMB's and LARS's
  per-tensor temporaries are not counted. The total adds this to the forward/backward
  parts, though the step comes after the activations are freed (a margin the size of
  this part).
- compute-dtype weight copies: one process under mixed precision autocasts
  (data_parallel.autocasts), and autocast's cache holds every weight's bf16 cast for the
  step. In a multi-process layout FSDP2/replicate hold the bf16
  unsharded parameters (at dp = 1 too, see data_parallel.needs_wrapper): every local
  parameter for ddp and zero2 (zero2 keeps them from forward to backward), the root and two
  blocks (one running, one prefetched) for zero3, all of them for zero3 under a pipeline
  (torch's pipelining turns resharding after backward off until the last microbatch).
- gradient buffers: FSDP2/replicate compute unsharded gradients per block in the compute
  dtype and reduce them in ``reduce_dtype``. When gradients accumulate without a reduction
  (ddp/zero2 over several DP ranks with several microbatches, which the trainer runs under
  no-sync, and any DP with
  a pipeline, which torch's pipelining runs under no-sync), FSDP2 keeps an unsharded
  ``reduce_dtype`` accumulator for every local parameter (``FSDPParam.
  to_accumulated_grad_if_needed``).
- activations in flight, logits and loss, the backward transient: ``activations.py``.
- pipeline buffers: a receive buffer per microbatch in flight (activations into non-first
  stages, gradients into non-last stages, and the input gradient on each activation buffer):
  ``parallel/pipeline.BoundedStage`` makes them when a receive is posted and drops them after
  the microbatch's backward, where torch 2.13's ``PipelineStage`` keeps one per microbatch
  of the step. The last stage keeps no
  microbatch outputs: the trainer calls ``schedule.step(..., return_outputs=False)``, so
  each microbatch's logits are freed after its backward (with torch's default
  ``return_outputs=True`` every microbatch's logits would stay until the next step:
  ``KEEPS_PIPELINE_OUTPUTS``).
- fp8 scaling state: torchao's dynamic (tensorwise/rowwise) scaling keeps no amax history;
  a 4-byte scale per converted weight is counted (precomputed for fp8 FSDP all-gathers).
- CUDA context and NCCL: 1 GiB, plus 1 GiB when there is more than one GPU (stated
  allowance: CUDA context and cuBLAS workspaces ~0.5-1 GiB, NCCL channel buffers ~1 GiB).
- allocator fragmentation: 28% of the phase's allocated bytes (PyTorch's caching allocator
  reserves more than it allocates; fitted on torchtitan's published reserved memory:
  ``FRAGMENTATION``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from pretrain.budget.compute import count_params
from pretrain.config.schema import Config
from pretrain.hardware.gpus import GIB, GpuSpec
from pretrain.model.gpt import ffn_dim, padded_vocab_size
from pretrain.optim.muon import orthogonalisation_bytes
from pretrain.optim.specs import spec
from pretrain.parallel.data_parallel import autocasts, needs_wrapper
from pretrain.parallel.layout import Layout
from pretrain.parallel.stages import stage_indices, stage_layers
from pretrain.planning.activations import (
    ActivationSetup,
    backward_working_bytes,
    head_and_loss,
    inflight_chunks,
    layer_bytes,
    layer_terms,
    live_recv_buffers,
)
from pretrain.planning.document import mask_bytes
from pretrain.planning.offload import defers_reduction
from pretrain.planning.params import StageParams, block_experts, inventory, rank_params
from pretrain.planning.phases import Backward, grads_at_backward_start, phase_parts
from pretrain.planning.pipeline_phases import PipelineRank, blocks_backward, forward_phase
from pretrain.planning.reducing import Reducing, reducing_phases
from pretrain.precision.policy import dtype_bytes

# PipelineStep (step_strategy.py) calls schedule.step(..., return_outputs=False): no logits kept
KEEPS_PIPELINE_OUTPUTS = False
# The caching allocator's reserve beyond the allocated peak: torchtitan's published peak
# *reserved* memory (planning/published.py, 10 rows) is 1.11-1.62x the planner's allocated
# peak by phase (less the CUDA context); 0.28 keeps every row at or under 1.15x and the
# 8B FSDP 8 row at 0.81 (tests/test_published.py). Fitted, not derived: the reserve grows
# with the largest transients (the 128k-vocabulary loss), which a share does not see.
FRAGMENTATION = 0.28

PARTS = (
    "parameters", "gradients", "optimizer state", "optimizer step transient",
    "compute-dtype weight copies", "all-gather outputs",
    "gradient buffers", "activations", "logits and loss", "backward transient",
    "pipeline buffers", "fp8 scaling state", "CUDA context + NCCL", "allocator fragmentation",
)


# What parallel.offload=params keeps in host memory instead (FSDP2's CPUOffloadPolicy).
OFFLOADED = ("parameters", "gradients", "optimizer state", "optimizer step transient")


@dataclass
class RankMemory:
    """``parts``: what each part holds at its own largest; ``phases``: what each phase of
    the step holds (planning/phases.py), the allowances (CUDA context, fragmentation of
    that phase) included; the total is the largest phase's."""

    pp_rank: int
    parts: dict[str, float]
    host: dict[str, float] = field(default_factory=dict)  # offloaded, per GPU
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    grads_held: bool = False  # the gradients exist at a backward's start

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def at_peak(self) -> dict[str, float]:
        """The parts held at the step's peak (the largest phase)."""
        return self.phases[self.peak_phase] if self.phases else self.parts

    @property
    def total(self) -> float:
        return sum(self.at_peak.values())

    @property
    def activation_peak(self) -> float:
        """What the activation tensors alone peak at (saved + transient)."""
        return sum(self.parts[k] for k in ("activations", "logits and loss",
                                           "backward transient"))


@dataclass
class MemoryEstimate:
    layout: Layout
    ranks: list[RankMemory]
    capacity: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def total(self) -> float:
        return self.worst.total

    @property
    def fits(self) -> bool:
        return self.fits_within(1.0)

    def fits_within(self, share: float) -> bool:
        """Whether the fullest rank needs at most ``share`` of the GPU's memory."""
        return self.capacity is None or self.total <= share * self.capacity


def activation_setup(cfg: Config, layout: Layout, device: str = "cuda") -> ActivationSetup:
    """How activations are stored for this config and layout (see activations.py)."""
    prec = cfg.precision
    e = dtype_bytes(prec.compute_dtype)
    mixed = prec.compute_dtype != prec.param_dtype
    attention = "eager" if cfg.model.attention == "eager" else "fused"
    # A wrapper (FSDP2 / replicate, data_parallel.needs_wrapper) casts the parameters: the
    # residual stream is in the compute dtype and each norm's output is one tensor of that
    # dtype, shared by the projections that read it. One process autocasts instead
    # (data_parallel.autocasts): fp32 parameters feed the matmuls, so the residual stream
    # is fp32, and on CUDA each projection casts the (fp32) norm output itself.
    auto = autocasts(layout, mixed)
    return ActivationSetup(
        micro_batch=layout.micro_batch_size, tp=layout.tp,
        sequence_parallel=layout.sequence_parallel and layout.tp > 1, attention=attention,
        compute_bytes=e, residual_bytes=dtype_bytes(prec.param_dtype) if auto else e,
        norm_copies=auto and device == "cuda", sp_saves_gathered=False,
        dropout=cfg.model.dropout, device=device, autocast=auto,
        fused_loss=cfg.train.compile and layout.tp == 1,  # parallel/apply.py's rule
    )


def _activations(cfg: Config, layout: Layout, a: ActivationSetup, pp_rank: int
                 ) -> tuple[float, float, float, float]:
    """(saved in flight, head + loss saved, the loss backward's transient, a block
    backward's transient) for one pipeline rank."""
    m = cfg.model
    ac, every = layout.activation_checkpointing, cfg.parallel.ac_every_n_layers
    stages = stage_indices(layout, pp_rank)
    chunks = inflight_chunks(layout.pp_schedule, layout.pp, layout.virtual_stages,
                             layout.microbatches, pp_rank)
    per_chunk = _per_chunk(cfg, layout, a, pp_rank)
    # Chunks in flight spread evenly over this rank's stages (stages hold equal layers).
    saved = chunks * sum(per_chunk) / len(per_chunk)
    saved += chunks * 8 * m.seq_len * a.micro_batch if 0 in stages else 0.0  # token ids
    saved += chunks * mask_bytes(cfg, a.micro_batch, a.device)  # document masking's
    head, loss_transient = (head_and_loss(m, a) if layout.n_stages - 1 in stages else (0.0, 0.0))
    work = backward_working_bytes(m, a)
    everything = layer_terms(m, replace(a, sp_saves_gathered=True))  # all a block makes
    if ac in ("full", "selective"):  # one block recomputed during its backward
        work += sum(everything.values()) - (layer_bytes(m, a, "selective")
                                            if ac == "selective" and every == 0 else 0)
    elif a.sequence_parallel:  # none keeps shards: the rest of one block made again
        work += sum(everything.values()) - layer_bytes(m, a, "none")
    return saved, head, loss_transient, work


def _per_chunk(cfg: Config, layout: Layout, a: ActivationSetup, pp_rank: int) -> list[float]:
    """One micro batch's saved activations through each of this rank's stages (its blocks
    under the checkpointing mode each runs)."""
    m = cfg.model
    ac, every = layout.activation_checkpointing, cfg.parallel.ac_every_n_layers
    rest = "selective" if ac == "selective" else ("full" if ac == "full" else "none")
    per_mode = {mode: layer_bytes(m, a, mode) for mode in {rest, "full"}}
    per_chunk = []
    for s in stage_indices(layout, pp_rank):
        layers = stage_layers(m.n_layer, s, layout.n_stages)
        whole = sum(1 for i in layers if ac == "selective" and every > 0
                    and (i + 1) % every == 0)
        per_chunk.append(whole * per_mode["full"] + (len(layers) - whole) * per_mode[rest])
    return per_chunk


def _pipeline_rank(cfg: Config, layout: Layout, a: ActivationSetup, sp: StageParams,
                   pp_rank: int, saved: float, wrapped: bool) -> PipelineRank:
    """What ``pipeline_phases`` needs of this pipeline rank."""
    e = dtype_bytes(cfg.precision.compute_dtype)
    layers = [len(stage_layers(cfg.model.n_layer, s, layout.n_stages))
              for s in stage_indices(layout, pp_rank)]
    starts = [sum(layers[:i]) for i in range(len(layers))]
    per_chunk = _per_chunk(cfg, layout, a, pp_rank)
    chunks = inflight_chunks(layout.pp_schedule, layout.pp, layout.virtual_stages,
                             layout.microbatches, pp_rank)
    return PipelineRank(
        chunks=chunks, per_chunk=tuple(per_chunk), layers=tuple(layers),
        roots=tuple(e * r for r in sp.roots),
        blocks=tuple(e * max(sp.blocks[i:i + n], default=0)
                     for i, n in zip(starts, layers, strict=True)),
        rest=saved - chunks * sum(per_chunk) / len(per_chunk),
        resharded=wrapped and layout.dp_spec.reshard_after_forward)


def _pipeline_buffers(cfg: Config, layout: Layout, a: ActivationSetup, pp_rank: int) -> float:
    if layout.pp == 1:
        return 0.0
    m = cfg.model
    act = a.residual_bytes * m.seq_len * a.micro_batch * m.d_model / (
        layout.tp if a.sequence_parallel else 1)
    total = 0.0
    stages = stage_indices(layout, pp_rank)
    # parallel/pipeline.BoundedStage: buffers for the microbatches in flight, not all
    live = live_recv_buffers(layout.pp_schedule, layout.pp, layout.virtual_stages,
                             layout.microbatches, pp_rank)
    for s in stages:
        if s != 0:  # activation receive buffer and the input gradient left on it
            total += 2 * live * act
        if s != layout.n_stages - 1:  # gradient receive buffer
            total += live * act
        elif KEEPS_PIPELINE_OUTPUTS:  # every microbatch's logits
            total += (layout.microbatches * a.compute_bytes * m.seq_len * a.micro_batch
                      * padded_vocab_size(m) / layout.tp)
    return total


def _weights_and_grad_buffers(cfg: Config, layout: Layout, sp: StageParams
                              ) -> tuple[float, float, float]:
    prec = cfg.precision
    e, reduce_b = dtype_bytes(prec.compute_dtype), dtype_bytes(prec.reduce_dtype)
    biggest_block = max(sp.blocks, default=0)
    mixed = prec.compute_dtype != prec.param_dtype
    if autocasts(layout, mixed):  # autocast's cache: each weight's cast, for the whole step
        return e * sp.local, 0.0, 0.0
    if not needs_wrapper(layout, mixed):
        return 0.0, 0.0, 0.0  # no DP wrapper: no copies, gradients straight into .grad
    if layout.dp_spec.reshard_after_forward and layout.pp == 1:
        weights = e * (sp.root + 2 * biggest_block)
    else:
        weights = e * sp.unsharded
    accumulate = defers_reduction(layout)  # else each backward reduces (dp=1 too)
    if accumulate:  # FSDP2's unsharded accumulators, and one block's gradient being made
        accumulators = reduce_b * sp.unsharded
        return weights, accumulators + e * max(biggest_block, sp.root), accumulators
    # one group's gradient reduced while the next block's is made (measured: --simulate)
    return weights, (e + reduce_b) * max(sp.root, biggest_block) + e * biggest_block, 0.0


@functools.lru_cache(maxsize=1024)
def optimizer_state_bytes(name: str, sp: StageParams, pb: int) -> int:
    """Bytes of ``optim.name``'s state for the parameters ``sp`` (``pb`` bytes each): its
    spec's ``state_bytes`` of each tensor's shard, summed (once per holding: a layout
    search asks again for every candidate with the same shards)."""
    state = spec(name).state_bytes
    return sum(state(n, shape, local, pb) for n, shape, local in sp.held)


def _optimizer_transient(cfg: Config, layout: Layout, sp: StageParams, pb: int) -> float:
    """Muon's one matrix at a time (``muon.ShardedMuon._update``): the Nesterov update
    ``g.lerp(buf, momentum)``, a new tensor the size of this rank's shard; then the whole
    matrix, gathered when FSDP or TP shards it over more than one rank (every block matrix
    is TP-sharded; on a mesh of one rank ``full_tensor`` returns the shard itself, no copy:
    measured), orthogonalised in bf16. AdamW's share of the step, fused as the GPU builds
    it, holds no temporaries (measured: tools/plan.py --simulate)."""
    if not spec(cfg.optim.name).orthogonalises or not sp.muon_largest:
        return 0.0
    fsdp = layout.dp_spec.shards and layout.dp_shard > 1
    gathered = pb if fsdp or layout.tp > 1 else 0
    m, n = sp.muon_largest
    shards = layout.tp * (layout.dp_shard if fsdp else 1)
    nesterov = pb * math.ceil(m / shards) * n  # the shard, to a row
    ns = dtype_bytes(cfg.optim.muon_ns_dtype)
    return float(nesterov + orthogonalisation_bytes(sp.muon_largest, gathered, ns))


def rank_memory(cfg: Config, layout: Layout, pp_rank: int, device: str = "cuda") -> RankMemory:
    prec = cfg.precision
    pb = dtype_bytes(prec.param_dtype)
    sp = rank_params(cfg.model, layout, pp_rank)
    a = activation_setup(cfg, layout, device)
    grads = pb * sp.local
    wrapped = needs_wrapper(layout, prec.compute_dtype != prec.param_dtype)
    if (layout.tp > 1 and not wrapped and cfg.model.pos_emb == "learned"
            and 0 in stage_indices(layout, pp_rank)):
        # DTensor's embedding backward leaves the sharded position table a Replicate grad
        # (a DP wrapper reduce-scatters it into its shard)
        pos = cfg.model.seq_len * cfg.model.d_model
        grads += pb * (pos - pos // layout.tp)
    weights, buffers, accumulators = _weights_and_grad_buffers(cfg, layout, sp)
    saved, head, loss_transient, work = _activations(cfg, layout, a, pp_rank)
    parts = {
        "parameters": pb * sp.local,
        "gradients": grads,
        "optimizer state": optimizer_state_bytes(cfg.optim.name, sp, pb),
        "optimizer step transient": _optimizer_transient(cfg, layout, sp, pb),
        "compute-dtype weight copies": weights,
        "gradient buffers": buffers,
        "activations": saved,
        "logits and loss": head,
        "backward transient": max(loss_transient, work),
        "pipeline buffers": _pipeline_buffers(cfg, layout, a, pp_rank),
        "fp8 scaling state": 4.0 * sp.n_linear if prec.fp8 else 0.0,
    }
    host = {k: parts.pop(k) for k in OFFLOADED} if layout.offload == "params" else {}
    held = grads_at_backward_start(_earlier_micro_batches(layout, cfg), accumulators > 0)
    # ZeRO-3 reshards every group after forward, the root too (measured: --simulate): the
    # loss's backward runs before the head's weights are gathered again
    resharded = layout.dp_spec.reshard_after_forward and layout.pp == 1 and wrapped
    phases = phase_parts(parts, Backward(accumulators, held, loss_transient, work,
                                         0.0 if resharded else weights))
    if layout.pp > 1:
        pr = _pipeline_rank(cfg, layout, a, sp, pp_rank, saved, wrapped)
        phases["forward"] = forward_phase(phases["loss backward"], pr)
        if pr.resharded and "blocks backward" in phases:
            phases["blocks backward"] = blocks_backward(phases["blocks backward"], pr)
    if wrapped and not accumulators and layout.pp == 1 and layout.offload == "none":
        phases.pop("blocks backward")
        phases.update(reducing_phases(parts, _reducing(cfg, layout, a, sp, parts, held, work)))
    if device == "cuda":
        for held in (parts, *phases.values()):
            held["allocator fragmentation"] = FRAGMENTATION * sum(held.values())
            held["CUDA context + NCCL"] = (1 + (layout.world_size > 1)) * GIB
    return RankMemory(pp_rank, parts, host, phases, held)


def _reducing(cfg: Config, layout: Layout, a: ActivationSetup, sp: StageParams,
              parts: dict[str, float], held: bool, work: float) -> Reducing:
    """The inputs of ``reducing.reducing_phases`` for one stage (no pipeline). Under EP a
    block is two FSDP groups: its routed experts (sharded over dp_shard / ep ranks) and the
    rest (over dp_shard)."""
    m, prec = cfg.model, cfg.precision
    e, rb = dtype_bytes(prec.compute_dtype), dtype_bytes(prec.reduce_dtype)
    pb = dtype_bytes(prec.param_dtype)
    ac, every = layout.activation_checkpointing, cfg.parallel.ac_every_n_layers
    rest = "selective" if ac == "selective" else ("full" if ac == "full" else "none")
    saved = tuple(layer_bytes(m, a, "full" if ac == "selective" and every > 0
                              and (i + 1) % every == 0 else rest) for i in range(m.n_layer))
    vocab = padded_vocab_size(m)
    head = vocab // layout.tp * m.d_model + m.d_model  # the head and the final norm
    # the embedding's gradient: the whole vocabulary's (under TP too), the TP shard's copy,
    # the tied weights' sum, a learned position table's
    emb = vocab * m.d_model + (vocab // layout.tp * m.d_model if layout.tp > 1 else 0)
    emb += vocab // layout.tp * m.d_model if m.tie_embeddings else 0
    emb += m.seq_len * m.d_model if m.pos_emb == "learned" else 0
    experts = block_experts(m, layout) if layout.ep > 1 else (0,) * len(sp.blocks)
    dense = tuple(b - x for b, x in zip(sp.blocks, experts, strict=True))
    shards = layout.dp_shard if layout.dp_spec.shards else 1
    # a dense block's backward makes its MLP output projection's gradient first
    first = 0 if layout.ep > 1 else m.d_model * ffn_dim(m) // layout.tp
    return Reducing(
        weights=tuple(e * d for d in dense), expert_weights=tuple(e * x for x in experts),
        grads=tuple(pb * (d / shards + x / max(shards // layout.ep, 1))
                    for d, x in zip(dense, experts, strict=True)),
        reduce=tuple(rb * d for d in dense), saved=saved,
        saved_rest=max(parts["activations"] - sum(saved), 0.0), root_weights=e * sp.root,
        root_reduce=rb * sp.root,
        all_gathered=0.0 if layout.dp_spec.reshard_after_forward else e * sp.unsharded,
        grads_held=held, head_grad=e * head, embedding_grad=e * emb, work=work,
        recompute=work - backward_working_bytes(m, a), first_grad=e * first)


def _earlier_micro_batches(layout: Layout, cfg: Config) -> bool:
    """Whether a backward can start with an earlier micro batch's (or step's) gradients
    held: accumulation, a pipeline, or CUDA graphs (train_module.keep_grads)."""
    graphs = str(cfg.train.cuda_graphs).lower() in ("true", "auto") and layout.one_device
    return layout.microbatches > 1 or layout.pp > 1 or graphs



def estimate_memory(cfg: Config, layout: Layout, gpu: GpuSpec | None = None,
                    device: str = "cuda") -> MemoryEstimate:
    """Memory of the fullest pipeline rank (rank 0: most microbatches in flight and the
    embeddings; the last rank: the head and loss; middle ranks hold less)."""
    ranks = sorted({0, layout.pp - 1})
    return MemoryEstimate(layout, [rank_memory(cfg, layout, r, device) for r in ranks],
                          capacity=gpu.memory_bytes if gpu is not None else None)


def checkpoint_bytes(cfg: Config) -> float:
    """Bytes of one checkpoint on disk: every stored parameter (padded vocabulary rows
    included) in the parameter dtype, and the optimizer's moments in the same dtype (the
    estimate's "parameters" and "optimizer state", summed over the whole model: the
    optimizer spec's ``state_bytes`` of each whole tensor)."""
    counts = count_params(cfg.model)
    n, pb = counts.total + counts.padding, dtype_bytes(cfg.precision.param_dtype)
    state = spec(cfg.optim.name).state_bytes
    return float(pb * n + sum(state(p.name, p.shape, p.shape, pb)
                              for p in inventory(cfg.model)))
