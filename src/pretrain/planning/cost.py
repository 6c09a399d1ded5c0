"""Step time of a layout: the cost model ``parallel=auto`` ranks layouts by.

Stated assumptions (an idealised model for ranking layouts, not a promise of throughput):

- Compute runs at the GPU's dense peak for the compute dtype (fp8: the block Linear FLOPs at
  the fp8 peak) times its calibrated ``kernel_efficiency`` (conf/gpu/, fitted on measured
  runs: docs/benchmarks.md), eager blocks at ``EAGER_SPEED`` of compiled ones. Hardware FLOPs are
  model FLOPs (``budget.flops_per_token``: 6 N + 12 L h s
  per token) plus recomputation: full checkpointing re-runs each block's forward (a third of
  its FLOPs), op-level selective re-runs every other block Linear's forward
  (parallel/activation_checkpoint.recomputed_linears).
- Tensor parallel: per block and microbatch, 2 all-reduces forward and 2 backward of the
  block's activations (b s h in the compute dtype), or the same volume as reduce-scatter +
  all-gather with sequence parallelism (Korthikanti et al. 2022, section 4.2.2); full
  recompute adds the 2 forward ones again. A ring moves 2 (t-1)/t of the bytes per GPU for
  an all-reduce. Over NVLink when t fits in a node, else the network. Not overlapped, except
  under ``parallel.async_tp``: each fused all-gather + matmul or matmul + reduce-scatter runs
  in t steps, the transfers behind partial matmuls, so all but 1/t of the blocks' TP
  traffic hides, up to the block matmuls' own time (the embedding's stays exposed).
- Pipeline: bubble fraction (p - 1) / (m v) of the compute for GPipe, 1F1B (v = 1) and
  interleaved 1F1B (Narayanan et al. 2021, section 2.2); ZB-V: a third of that with v = 2
  (splitting the weight gradient fills 2/3 of a 1F1B bubble when F = B = W; Qi et al. 2024,
  section 3; the ideal zero bubble is not assumed). Point-to-point: one activation forward
  and one gradient backward per microbatch and stage boundary, over the network when a
  pipeline neighbour is on another node (ranks fill nodes TP first, then DP). Not overlapped.
- Data parallel, per GPU, over NVLink when the DP group (times TP) fits in a node, else the
  network at g x its per-GPU bandwidth when a node holds g of the group's ranks (one ring
  per NIC rail, NCCL's channels; at most NVLink's): ddp all-reduces the gradients (reduce dtype)
  once per step; zero2 reduce-scatters
  them and all-gathers parameters (compute dtype) once per step; zero3 all-gathers twice and
  reduce-scatters once per microbatch (the trainer reduces every microbatch under zero3);
  under a pipeline torch reduces once per step and, as it keeps parameters unsharded after
  each backward (``reshard_after_backward=False``) until zero3 reshards them after the next
  forward, gathers once per microbatch. HSDP reduce-scatters within ``dp_shard``
  and all-reduces the shard across ``dp_replicate``.
  Overlap: gradient reductions hide behind the backward of the last microbatch (2/3 of its
  compute) and the zero2 all-gather behind the first forward (1/3); zero3's per-microbatch
  traffic hides behind the whole step's compute. With a pipeline, torch 2.13 runs the DP
  reduction after the last backward (``PipelineStage``), so it is fully exposed.
- Expert parallelism: per MoE layer and microbatch, each token's top_k copies go to their
  experts' ranks and come back (dispatch and combine, b s k h in the compute dtype), and the
  same again in backward; an all-to-all sends (ep - 1)/ep of them off the rank. Over NVLink
  when the EP group (times TP) fits in a node. Not overlapped. The experts' FSDP traffic
  spans dp_shard / ep ranks, the rest of the model's dp_shard.
- Offload (``parallel.offload=params``, FSDP2's CPUOffloadPolicy): each all-gather first
  copies the rank's parameter shard host-to-device, each reduce-scatter copies the
  gradient shard back, over PCIe at the GPU type's ``pcie_gbps`` (one direction); the
  host sums each gradient shard after the first into its gradient and runs the AdamW step
  (torch's single-tensor for-loop, as build_optimizer makes it for host parameters, unless
  optim.fused=true), at the per-parameter times measured on a real host
  (planning/calibration.py, tools/bench_offload.py). Not overlapped.
- Host dispatch: the host launches kernels ahead of the GPU, so forward and backward take
  max(GPU time, host time) (offload's copies and host step then follow). Host time = the
  aten ops the step dispatches (planning/dispatch.py counts them on the CPU) at a per-op
  cost, plus FSDP2's per-unit hooks where a wrapper goes on; compiled blocks per call;
  one process compiled (model and loss one graph) per kernel launch. Constants:
  planning/calibration.py, fitted on recorded H100 runs.
- One GPU (no collectives beside its kernels): the matmuls at a width-dependent fraction of
  the peak, plus the memory-bound kernels' bytes at the GPU type's ``memory_gbps``
  (planning/calibration.py, fitted on one H100 and one H200).
- Every call (collective or p2p, one per FSDP unit for DP) also costs a fixed latency: 10 us
  within a node, 30 us across nodes (NCCL small-message latencies are of this order); it only
  matters for small models, where bandwidth terms vanish.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pretrain.budget.compute import Budget
from pretrain.config.schema import Config
from pretrain.hardware.gpus import GpuSpec
from pretrain.parallel.activation_checkpoint import recomputed_linears
from pretrain.parallel.data_parallel import needs_wrapper
from pretrain.parallel.layout import Layout
from pretrain.parallel.stages import stage_indices, stage_layers
from pretrain.planning.calibration import (
    GPU_HOST,
    HOST_S_PER_COMPILED_BLOCK,
    HOST_S_PER_FSDP_UNIT,
    SOLO_BYTES_PER_LAYER_ELEMENT,
    SOLO_EAGER_SPEED,
    SOLO_EFFICIENCY_MAX,
    SOLO_FIT_KERNEL_EFFICIENCY,
    SOLO_HALF_WIDTH,
    HostCosts,
)
from pretrain.planning.document import attention_work
from pretrain.planning.host import graph_calls, outside_seconds
from pretrain.planning.offload import offload_seconds
from pretrain.planning.params import expert_share, linear_elements, rank_params
from pretrain.precision.policy import dtype_bytes


@dataclass(frozen=True)
class StepCost:
    """Seconds per optimizer step, by component, and the MFU bound it implies."""

    compute: float
    recompute: float
    tp_comm: float
    pp_bubble: float
    pp_p2p: float
    dp_comm: float  # total DP traffic time
    dp_exposed: float  # the part not hidden behind compute
    mfu: float  # model FLOPs / (step time x peak): an upper bound for the real MFU
    ep_comm: float = 0.0  # expert parallelism's all-to-all token exchange
    offload: float = 0.0  # host<->device copies and the optimizer step on the host
    tp_hidden: float = 0.0  # TP traffic async TP overlaps with matmuls (not in the total)
    host: float = 0.0  # the host's dispatch time: the step waits for it when it is longer

    @property
    def device(self) -> float:
        """The GPU's (and the links') time, offload's serial host work included."""
        return (self.compute + self.recompute + self.tp_comm + self.pp_bubble + self.pp_p2p
                + self.dp_exposed + self.ep_comm + self.offload)

    @property
    def host_bound(self) -> bool:
        return self.host > self.device - self.offload

    @property
    def total(self) -> float:
        """The host launches kernels ahead of the GPU, so forward and backward take the
        longer of the two (overlap assumed complete): the GPU's time, or the host's dispatch
        time when host-bound. Offload's copies and host step follow, not overlapped."""
        return max(self.device - self.offload, self.host) + self.offload

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "device": self.device,
                "host_bound": self.host_bound}


LATENCY_NODE_S = 10e-6  # per collective / p2p call within a node (NCCL small-message scale)
LATENCY_NETWORK_S = 30e-6  # across nodes


def _link(gpu: GpuSpec, ranks_in_group_span: int) -> float:
    """Bytes/s of the slowest link a group spanning this many consecutive ranks crosses."""
    gbps = gpu.nvlink_gbps if ranks_in_group_span <= gpu.gpus_per_node else gpu.network_gbps
    return gbps * 1e9


def _ring_link(gpu: GpuSpec, stride: int, ranks: int) -> float:
    """Bytes/s per GPU of a ring collective over ``ranks`` ranks ``stride`` apart. Across
    nodes, a node holding g of the group's ranks runs g rings at once (NCCL's channels, one
    per NIC rail), each leaving the node through its own NIC, so the network carries 1/g of
    every rank's traffic per NIC: g x the per-GPU network bandwidth, at most NVLink's. A
    group of one rank per node (TP filling the node) gets one NIC's bandwidth."""
    if stride * ranks <= gpu.gpus_per_node:
        return gpu.nvlink_gbps * 1e9
    per_node = min(ranks, max(1, gpu.gpus_per_node // stride))
    return min(gpu.nvlink_gbps, gpu.network_gbps * per_node) * 1e9


def _alpha(gpu: GpuSpec, ranks_in_group_span: int) -> float:
    """Fixed cost of one call (latency), which dominates for small models."""
    return LATENCY_NODE_S if ranks_in_group_span <= gpu.gpus_per_node else LATENCY_NETWORK_S


# Eager blocks against compiled ones: torchtitan's Llama 3.1 8B on 8 H100 (FSDP, selective
# AC), 5,762 tokens/s eager against 6,667 compiled (benchmarks/llama3_h100_202412_torchtitan.md).
EAGER_SPEED = 5762 / 6667


def solo_efficiency(cfg: Config, gpu: GpuSpec) -> float:
    """Fraction of the dense peak one GPU's matmuls and attention reach at this width
    (planning/calibration.py: fitted on one H200, scaled by the type's kernel_efficiency)."""
    d = cfg.model.d_model
    scale = gpu.kernel_efficiency / SOLO_FIT_KERNEL_EFFICIENCY
    return SOLO_EFFICIENCY_MAX * d / (d + SOLO_HALF_WIDTH) * scale


def kernel_slowdown(cfg: Config, gpu: GpuSpec, world_size: int = 2) -> float:
    """How much longer than at the dense peak the kernels take: 1 / (the GPU type's
    calibrated ``kernel_efficiency``), and eager blocks ``EAGER_SPEED`` of compiled ones.
    One GPU runs no collectives beside its kernels: ``solo_efficiency``, eager at
    ``SOLO_EAGER_SPEED`` (planning/calibration.py)."""
    if world_size == 1:
        eager = 1.0 if cfg.train.compile else SOLO_EAGER_SPEED
        return 1 / solo_efficiency(cfg, gpu) / eager
    return 1 / gpu.kernel_efficiency / (1.0 if cfg.train.compile else EAGER_SPEED)


def memory_bound_seconds(cfg: Config, layout: Layout, gpu: GpuSpec, tokens: int) -> float:
    """One GPU's memory-bound kernels a step: SOLO_BYTES_PER_LAYER_ELEMENT bytes per token,
    layer and d_model element at the type's memory bandwidth; 0 on several GPUs (their
    kernel_efficiency was fitted with it inside) or a type without ``memory_gbps``."""
    if layout.world_size != 1 or not gpu.memory_gbps:
        return 0.0
    m = cfg.model
    return SOLO_BYTES_PER_LAYER_ELEMENT * m.n_layer * m.d_model * tokens / (gpu.memory_gbps * 1e9)


def host_seconds(cfg: Config, layout: Layout, wrapped: bool | None = None,
                 costs: HostCosts = GPU_HOST) -> float:
    """Host time to dispatch one step of this rank (planning/dispatch.py counts the ops),
    per the path the trainer takes (parallel/apply.py): one process compiled runs model and
    loss as one graph (its kernels' launches, its inputs' guards and wrappers:
    ``host.graph_calls``); compiled blocks elsewhere (a call each, the rest eager); eager,
    every op, the chunked loss's loop included; FSDP2's hooks per unit where a wrapper goes
    on (``wrapped``: the layout's answer unless given); then what runs
    outside that region (planning/host.py: AccumulateGrad, clipping, the optimizer step,
    the step's bookkeeping and the loop's Python). A pipeline rank is charged its blocks
    and, an upper bound, the embeddings, head and loss too. ``costs``: a GPU machine's host
    (``calibration.GPU_HOST``) or this CPU's (``host_check.calibrate``: tools/host_time.py)."""
    from pretrain.planning.dispatch import count_ops, loss_chunks

    m = cfg.model
    c = count_ops(m)
    mixed = cfg.precision.compute_dtype != cfg.precision.param_dtype
    if wrapped is None:
        wrapped = needs_wrapper(layout, mixed)
    blocks = m.n_layer // layout.pp
    fused_loss = cfg.train.compile and layout.tp == 1  # parallel/apply.py: loss compiled
    chunks = 0 if fused_loss else loss_chunks(m, layout.micro_batch_size,
                                              vocab_sharded=layout.tp > 1)
    loss = c.loss_base + c.loss_per_chunk * chunks
    if cfg.train.compile and layout.world_size == 1 and not wrapped:  # one graph
        launches, inputs = graph_calls(cfg, layout)
        per_mb = costs.per_graph + inputs * costs.per_input + launches * costs.per_launch
    elif cfg.train.compile:
        per_mb = (c.outside + loss) * costs.per_op + blocks * HOST_S_PER_COMPILED_BLOCK
    else:
        per_mb = costs.per_region + (c.outside + blocks * c.per_block + loss) * costs.per_op
    if wrapped:
        per_mb += (blocks + 1) * HOST_S_PER_FSDP_UNIT
    return layout.microbatches * per_mb + outside_seconds(cfg, layout, costs)


def _selective_recompute(cfg: Config, block_fwd: float) -> float:
    """Forward FLOPs per token that selective checkpointing re-runs: whole blocks every
    ``ac_every_n_layers``, else the op-level policy's recomputed Linears
    (parallel/activation_checkpoint.recomputed_linears; elementwise ops not counted)."""
    m, every = cfg.model, cfg.parallel.ac_every_n_layers
    if every > 0:
        return block_fwd * (m.n_layer // every) / m.n_layer
    linear = linear_elements(m)
    return sum(2 * linear.get(name, 0) for name in set(recomputed_linears(m)))


def _sp_recompute(cfg: Config, layout: Layout) -> float:
    """Forward FLOPs per token ``none`` re-runs under sequence parallelism: eager, the
    attention output projection (its output feeds a kept reduce-scatter); compiled,
    nothing (the partitioner recomputes only what a gradient needs)."""
    if not layout.sequence_parallel or layout.tp == 1 or cfg.train.compile:
        return 0.0
    return 2 * linear_elements(cfg.model).get("wo", 0)


def step_cost(cfg: Config, layout: Layout, gpu: GpuSpec, budget: Budget) -> StepCost:
    m, prec = cfg.model, cfg.precision
    t, p, d, mb = layout.tp, layout.pp, layout.dp, layout.microbatches
    v = layout.virtual_stages if p > 1 else 1
    e = dtype_bytes(prec.compute_dtype)
    tokens = budget.global_batch_tokens
    world = layout.world_size
    peak = gpu.peak_flops(prec.compute_dtype) or gpu.peak_flops("float32")
    model_flops = budget.flops_per_token * tokens / world

    # Compute (+ fp8 speed-up on the block Linears) and recomputation.
    linear = linear_elements(m)
    layer_matmul = linear["matmul"]  # the whole model's block Linear parameters
    if m.moe_experts:  # plus the routed experts a token uses (top_k of moe_experts)
        layer_matmul += linear["experts"] * m.moe_top_k // m.moe_experts
    attn_fwd = 4 * m.n_layer * m.d_model * m.seq_len  # per token, forward only
    block_fwd = 2 * layer_matmul + attn_fwd
    extra = {"full": block_fwd, "selective": _selective_recompute(cfg, block_fwd),
             "none": _sp_recompute(cfg, layout)}[layout.activation_checkpointing] * tokens / world
    linear_flops = 6 * layer_matmul * tokens / world  # this rank's block Linears
    linear_peak = gpu.peak_flops("float8") if prec.fp8 and gpu.peak_flops("float8") else peak
    compute = model_flops / peak - linear_flops / peak + linear_flops / linear_peak
    # document masking under FlexAttention skips wholly masked blocks (planning/document.py)
    compute -= (1 - attention_work(cfg)) * 3 * attn_fwd * tokens / world / peak
    recompute = extra / peak
    slow = kernel_slowdown(cfg, gpu, world)
    compute, recompute = compute * slow, recompute * slow
    compute += memory_bound_seconds(cfg, layout, gpu, tokens)

    tp_total, tp_hidden = _tensor_parallel(cfg, layout, gpu, linear_flops / linear_peak * slow)
    tp_comm = tp_total - tp_hidden

    # Pipeline bubble and point-to-point.
    bubble = p2p = 0.0
    if p > 1:
        frac = (p - 1) / (mb * v)
        if layout.pp_schedule == "zbv":
            frac = (p - 1) / (mb * 2) / 3
        bubble = frac * (compute + recompute + tp_comm)
        seq_div = t if layout.sequence_parallel else 1
        act = e * layout.micro_batch_size * m.seq_len * m.d_model / seq_div
        p2p = 2 * mb * v * (act / _link(gpu, t * d + 1) + _alpha(gpu, t * d + 1))

    ep_comm = _expert_parallel(cfg, layout, gpu)
    dp_comm, dp_exposed = _data_parallel(cfg, layout, gpu, compute + recompute)
    off = offload_seconds(cfg, layout, gpu)
    total = compute + recompute + tp_comm + bubble + p2p + dp_exposed + ep_comm + off
    bf16_peak = gpu.peak_flops("bfloat16") or peak
    host = host_seconds(cfg, layout)
    total = max(total - off, host) + off
    return StepCost(compute, recompute, tp_comm, bubble, p2p, dp_comm, dp_exposed,
                    mfu=model_flops / (total * bf16_peak), ep_comm=ep_comm, offload=off,
                    tp_hidden=tp_hidden, host=host)


def _tensor_parallel(cfg: Config, layout: Layout, gpu: GpuSpec, linear_time: float
                     ) -> tuple[float, float]:
    """(seconds per step of the TP collectives, the part async TP hides; 0 without TP).
    ``linear_time``: the step's block-Linear matmul time, which async TP overlaps with."""
    total, blocks = _tp_traffic(cfg, layout, gpu)
    if not layout.async_tp:
        return total, 0.0
    # Micro-pipelined: each fused collective + matmul runs in t steps, the transfer of one
    # step behind the partial matmul of another; the first step's transfer stays exposed,
    # and any traffic beyond the matmul time it pairs with (the vocab-parallel embedding's
    # reduce-scatter is no matmul's neighbour and stays exposed too).
    hidden = min(blocks * (layout.tp - 1) / layout.tp, linear_time)
    return total, hidden


def _tp_traffic(cfg: Config, layout: Layout, gpu: GpuSpec) -> tuple[float, float]:
    """(seconds per step of all TP collectives, those of the transformer blocks)."""
    m, t, mb = cfg.model, layout.tp, layout.microbatches
    if t == 1:
        return 0.0, 0.0
    act = dtype_bytes(cfg.precision.compute_dtype) * layout.micro_batch_size * m.seq_len * m.d_model
    # recomputation repeats forward collectives: both under full, the SP all-gathers
    # (not the saved reduce-scatters) under op-level selective and under none with SP
    # (which keeps the gathered inputs as shards)
    ac = layout.activation_checkpointing
    per_block = 6 if ac == "full" else (5 if layout.sequence_parallel else 4)
    layers = m.n_layer // layout.pp
    link, alpha = _link(gpu, t), _alpha(gpu, t)
    block = layers * mb * per_block * (2 * (t - 1) / t * act / link + alpha)
    head = mb * 4 * (2 * (t - 1) / t * act / link + alpha)  # vocab-parallel embedding, head
    return block + head, block


def moe_layers_per_rank(cfg: Config, layout: Layout) -> int:
    """MoE layers on the pipeline rank with the most of them (rank 0 holds the most)."""
    m = cfg.model
    if not m.moe_experts:
        return 0
    return sum(1 for s in stage_indices(layout, 0)
               for layer in stage_layers(m.n_layer, s, layout.n_stages)
               if layer >= m.moe_first_dense)


def _expert_parallel(cfg: Config, layout: Layout, gpu: GpuSpec) -> float:
    """Seconds per step of the all-to-all token exchange (0 without EP)."""
    ep, m = layout.ep, cfg.model
    if ep == 1:
        return 0.0
    rows = layout.micro_batch_size * m.seq_len * m.moe_top_k
    send = rows * m.d_model * dtype_bytes(cfg.precision.compute_dtype) * (ep - 1) / ep
    calls = 4 + (2 if layout.activation_checkpointing == "full" else 0)
    n = moe_layers_per_rank(cfg, layout) * layout.microbatches * calls
    span = ep * layout.tp
    return n * (send / _link(gpu, span) + 2 * _alpha(gpu, span))  # + the counts' exchange


def _data_parallel(cfg: Config, layout: Layout, gpu: GpuSpec, compute: float
                   ) -> tuple[float, float]:
    """(time of all DP traffic, the part not hidden behind compute) per step."""
    d = layout.dp
    if d == 1:
        return 0.0, 0.0
    prec = cfg.precision
    e, red = dtype_bytes(prec.compute_dtype), dtype_bytes(prec.reduce_dtype)
    sp = rank_params(cfg.model, layout)
    n = sp.unsharded  # this rank's TP/PP-local parameters
    units = len(sp.blocks) + layout.virtual_stages  # FSDP units: blocks + one root per stage
    mb, t = layout.microbatches, layout.tp
    per_mb = compute / mb
    if not layout.dp_spec.shards:
        reduce = 2 * (d - 1) / d * red * n / _ring_link(gpu, t, d) + units * _alpha(gpu, t * d)
        gather = 0.0
    else:
        shard, rep = layout.dp_shard, layout.dp_replicate
        experts = expert_share(cfg.model, layout) if layout.ep > 1 else 0
        # one call per MoE layer where the experts' FSDP group has more than one rank
        ecalls = moe_layers_per_rank(cfg, layout) if shard > layout.ep else 0
        rs = _ring(red, n - experts, shard, units, gpu, t) + _ring(
            red, experts, shard // layout.ep, ecalls, gpu, t)
        if rep > 1:  # HSDP: all-reduce of the shard across replicas (experts: their shard)
            held = (n - experts) / shard + experts / (shard // layout.ep)
            rs += (2 * (rep - 1) / rep * red * held / _ring_link(gpu, t * shard, rep)
                   + units * _alpha(gpu, t * d))
        ag = _ring(e, n - experts, shard, units, gpu, t) + _ring(
            e, experts, shard // layout.ep, ecalls, gpu, t)
        if not layout.dp_spec.reshard_after_forward:
            reduce, gather = rs, ag
        elif layout.pp > 1:  # gathered in each backward, kept for the next forward
            reduce, gather = rs, mb * ag
        else:
            reduce, gather = mb * rs, 2 * mb * ag
    total = reduce + gather
    if layout.pp > 1:  # reduced after the last backward: exposed; gathers overlap forward
        return total, reduce + max(0.0, gather - compute)
    if layout.dp_spec.reshard_after_forward:
        return total, max(0.0, total - compute)
    exposed = max(0.0, reduce - 2 / 3 * per_mb) + max(0.0, gather - per_mb / 3)
    return total, exposed



def _ring(nbytes: int, n: int, ranks: int, calls: int, gpu: GpuSpec, t: int) -> float:
    """One reduce-scatter or all-gather of ``n`` elements of ``nbytes`` over ``ranks``
    (ranks t apart), in ``calls`` calls."""
    if n == 0:
        return 0.0
    return ((ranks - 1) / ranks * nbytes * n / _ring_link(gpu, t, ranks)
            + calls * _alpha(gpu, t * ranks))
