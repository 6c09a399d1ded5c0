"""Be any rank of any cluster on this CPU: start it for real, measure what it holds.

``tools/plan.py --simulate`` joins a fake process group (torch's
``torch.testing._internal.distributed.fake_pg``: collectives return at once with the right
shapes; torchtitan dry-runs layouts the same way) of the recipe's world size as rank R, and
runs the training code's own start-up for that rank: the device mesh, ``parallelize``
(pipeline split, TP, activation checkpointing, FSDP2), ``materialize`` (this rank's shards
allocated and given their real initial values on the CPU) and the optimizer with its state.
Then, unless skipped, one forward and backward of one micro batch through each of the rank's
stages (and an optimizer step) runs on a second copy of the rank's model under
``FakeTensorMode``, where tensors have shapes but no storage, with torch's ``MemTracker``
counting the bytes a real step would hold.

What comes back is measured, next to what the planner (``planning/memory.py``) predicts for
the same rank, so the two can be compared wherever a simulation runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pretrain import torch_compat
from pretrain.config.schema import Config
from pretrain.hardware.device import peak_rss_bytes
from pretrain.model.gpt import GPT
from pretrain.model.initialization import local_region
from pretrain.model.loss import cross_entropy
from pretrain.optim.specs import build_optimizer
from pretrain.parallel.apply import ParallelModel, materialize, parallelize_gpt
from pretrain.parallel.data_parallel import autocasts
from pretrain.parallel.layout import Layout, resolve_layout
from pretrain.parallel.mesh import build_mesh
from pretrain.parallel.tensor_parallel import loss_context
from pretrain.planning.activations import inflight_chunks
from pretrain.planning.memory import rank_memory
from pretrain.planning.offload import defers_reduction
from pretrain.planning.params import rank_params
from pretrain.planning.phases import by_kind
from pretrain.precision.policy import Policy, dtype_bytes, resolve_policy

log = logging.getLogger("pretrain.simulate")


def _storages(t: torch.Tensor):
    """The real storages behind ``t``: a tensor subclass that wraps others (torchao's fp8
    weight for FSDP all-gathers) has none of its own."""
    if torch_compat.private("is_traceable_wrapper_subclass")(t):
        for attr in t.__tensor_flatten__()[0]:
            yield from _storages(getattr(t, attr))
    else:
        yield t.untyped_storage()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard; FSDP2's
    padded shard storage; a tied weight once): what is really allocated."""
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(local_region(t)[0]):
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _local_bytes(t: torch.Tensor) -> int:
    return local_region(t)[0].nbytes


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                         measure: bool = True) -> int:
    """Create the optimizer's state as its first step would, without changing a weight
    (zero gradients, learning rate 0: what torch.distributed.checkpoint does before loading
    into a fresh optimizer). Returns the bytes the gradients held meanwhile (0 unless
    ``measure``: fake tensors have no storage to measure)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    grads = sum(_local_bytes(p.grad) for p in params) if measure else 0
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    return grads


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))


def _build(cfg: Config, layout: Layout, mesh, policy: Policy, attention: str
           ) -> ParallelModel:
    # one process without offload runs with no mesh (train_module.join): no wrapper, autocast
    return parallelize_gpt(cfg, layout, None if layout.one_device else mesh,
                           torch.device("cpu"), policy, attention)


def _stage_input(part: GPT, cfg: Config, layout: Layout, policy: Policy) -> torch.Tensor:
    """One micro batch as this stage receives it: token ids on the first stage, else the
    residual stream (sequence-sharded under SP; in the compute dtype: FSDP2 or replicate
    casts the parameters under mixed precision, as the pipeline would send it)."""
    b, s = layout.micro_batch_size, cfg.model.seq_len
    if part.tok_emb is not None:
        return torch.randint(0, cfg.model.vocab_size, (b, s))
    if layout.sequence_parallel and layout.tp > 1:
        s //= layout.tp
    dtype = policy.compute_dtype  # FSDP2 casts the parameters: the stream is in it
    return torch.randn(b, s, cfg.model.d_model, dtype=dtype, requires_grad=True)


def _forward(part: GPT, x: torch.Tensor, cfg: Config, layout: Layout) -> torch.Tensor:
    """One micro batch through one stage: the real loss on the last stage, a sum of the
    output (standing in for the next stage's gradient) elsewhere."""
    out = part(x)
    if part.lm_head is not None:
        targets = torch.randint(0, cfg.model.vocab_size,
                                (layout.micro_batch_size, cfg.model.seq_len))
        return cross_entropy(out, targets)
    local = out.to_local() if isinstance(out, DTensor) else out
    return local.float().sum()


def _forward_backward(part: GPT, x: torch.Tensor, cfg: Config, layout: Layout,
                      policy: Policy) -> None:
    """One micro batch through one stage and back."""
    with loss_context(layout.tp):
        _forward(part, x, cfg, layout).backward()


def _forget(tracker, part: torch.nn.Module) -> None:
    """MemTracker refuses a module's second forward ("multiple iterative calls"): its
    per-module statistics (not the device totals measured here) are dropped first."""
    for module in part.modules():
        tracker.memory_tracking.pop(module, None)


def _measured_micro_batches(pm: ParallelModel, inputs: list[list[torch.Tensor]], cfg: Config,
                            layout: Layout, policy: Policy, tracker, unreduced: bool) -> None:
    """Under the tracker: the accumulators' micro batch first when ``unreduced``, then the
    rank's micro batches in flight (a pipeline) or one through each stage."""
    for part in pm.parts if unreduced else ():
        _forget(tracker, part)
        _forward_backward(part, _stage_input(part, cfg, layout, policy), cfg, layout, policy)
    if layout.pp > 1:
        _in_flight(pm, inputs, cfg, layout, tracker)
        return
    for part, x in zip(pm.parts, inputs[0], strict=True):
        _forget(tracker, part)
        _forward_backward(part, x, cfg, layout, policy)


def _in_flight(pm: ParallelModel, inputs: list[list[torch.Tensor]], cfg: Config,
               layout: Layout, tracker) -> None:
    """The rank's micro batches in flight at its peak (``inputs[i]``: the i-th one's input
    to each of the rank's stages): every forward first, spread over the stages as the
    schedule's steady state holds them, then their backwards."""
    losses = []
    with loss_context(layout.tp):
        for i, xs in enumerate(inputs):
            _forget(tracker, pm.parts[i % len(pm.parts)])
            losses.append(_forward(pm.parts[i % len(pm.parts)], xs[i % len(pm.parts)], cfg,
                                   layout))
        for loss in losses:
            loss.backward()


def _earlier_gradients(pm: ParallelModel, cfg: Config, layout: Layout,
                       params: list[torch.nn.Parameter]) -> bool:
    """Gradients an earlier micro batch (or step) left, before the measured one: the
    sharded gradients accumulated into (accumulation, a pipeline without a DP wrapper, CUDA
    graphs: made here, untracked), or, where they accumulate unreduced in FSDP2's
    unsharded accumulators (DDP/ZeRO-2 no-sync, a pipeline, which also keeps the weights
    gathered until the last micro batch), True: the caller runs that micro batch, tracked
    (its accumulators are tensors only a backward makes)."""
    wrapped = [p for p in pm.parts if hasattr(p, "set_requires_gradient_sync")]
    if wrapped and defers_reduction(layout):
        for part in wrapped:
            part.set_requires_gradient_sync(False)
            if layout.pp > 1:
                part.set_reshard_after_backward(False)
        return True
    if layout.microbatches > 1 or layout.pp > 1 or str(cfg.train.cuda_graphs).lower() == "true":
        for p in params:
            p.grad = torch.zeros_like(p)
    return False


def _bytes(snapshot: dict) -> int:
    """The largest per-device total of a MemTracker snapshot (one device here)."""
    return max((snap.get("Total", 0) for snap in snapshot.values()), default=0)


def _by_kind(snapshot: dict) -> dict[str, int]:
    return {getattr(k, "value", str(k)): v for snap in snapshot.values()
            for k, v in snap.items() if k != "Total"}


# The device the simulated run trains on: the optimizer is built for it (fused AdamW on
# CUDA, build_optimizer's rule), though this CPU holds the (fake) parameters.
TARGET = torch.device("cuda")


def optimizer_device(layout: Layout) -> torch.device:
    """Where the GPU run's optimizer steps, as the trainer passes it to build_optimizer
    (``ParallelModel.param_device``): the host under parallel.offload=params, else the GPU."""
    return torch.device("cpu") if layout.offload == "params" else TARGET


def _build_optimizer(pm: ParallelModel, cfg: Config, lr: float,
                     device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    return build_optimizer(torch.nn.ModuleList(pm.parts), cfg.optim, lr, device,
                           also_embeddings=pm.tied.params if pm.tied is not None else ())


def implementation(optimizer: torch.optim.Optimizer) -> list[tuple[str, bool, bool]]:
    """(class, fused, foreach) of each torch optimizer inside ``optimizer`` (both of
    MuonWithAdamW's): which kernels its step runs, so what it holds while stepping."""
    parts = [getattr(optimizer, k) for k in ("muon", "adamw") if hasattr(optimizer, k)]
    return [(type(o).__name__, bool(o.defaults.get("fused")), bool(o.defaults.get("foreach")))
            for o in parts or [optimizer]]


@contextlib.contextmanager
def untracked_sharding_propagation():
    """Keep DTensor's sharding propagation out of what MemTracker measures. DTensor works
    out an op's output placement by running it on global-shape fake tensors, in the fake
    mode it detects: ours, so a tracker inside it counts them as if the step held them.
    torch 2.13 caches that per op and shape (a warm step keeps it out of the measured one);
    torch 2.11 re-runs it for ``_fused_adamw_`` at every step, and its MemTracker counted
    the whole model's fp32 weights, gradients and moments at global shape (the llama3-8b
    zero3 rank: 126.79 GiB "optimizer step" against 14.96). The real run allocates nothing
    there. Here propagation runs with the dispatch modes (tracker, our fake mode) set
    aside, in a fake mode of its own. Written against torch 2.11-2.13's private
    ``ShardingPropagator._propagate_tensor_meta_non_cached``; on a torch without it the
    measurement is left as it is, and a warning says so."""
    ShardingPropagator = torch_compat.private("ShardingPropagator")  # noqa: N806 (a class)
    _disable_current_modes = torch_compat.private("disable_current_modes")

    name = "_propagate_tensor_meta_non_cached"
    original = getattr(ShardingPropagator, name, None)
    if original is None:
        log.warning("torch %s has no ShardingPropagator.%s: the measured step may count "
                    "DTensor's global-shape sharding propagation (update "
                    "simulate.untracked_sharding_propagation)", torch.__version__, name)
        yield
        return

    def aside(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    setattr(ShardingPropagator, name, aside)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


@torch.no_grad()
def _warm_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """One optimizer step on zero gradients, untracked: DTensor works out the sharding of
    each op once per shape (running it on global-shape fake tensors, which MemTracker
    counts under an outer FakeTensorMode: 3 whole fp32 matrices for Muon's first ``lerp``)
    and caches it; the measured step then holds what a step after the first holds."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fake_step(cfg: Config, layout: Layout, mesh, policy: Policy, attention: str,
              pp_rank: int = 0) -> dict:
    """One training step of this rank on a fake copy of its model (nothing allocated), as
    a step after the first holds it: the optimizer's state exists before the step begins.
    Measured apart, with torch's MemTracker: the peak of one micro batch's forward and
    backward through each of the rank's stages (when a step has several micro batches, one
    after the first: the gradients it accumulates into exist), and the peak of the
    optimizer step that follows (whose excess over what the step starts with is its
    transient: Muon's gathered matrices and Newton-Schulz's working set). A pipeline keeps
    several micro batches in flight: this rank's count at its peak (``inflight_chunks``)
    run forward, then backward (no p2p: each stage's input is made here)."""
    FakeTensorMode = torch_compat.private("FakeTensorMode")  # noqa: N806 (a class)
    MemTracker = torch_compat.private("MemTracker")  # noqa: N806

    pm = _build(cfg, layout, mesh, policy, attention)  # on the meta device
    with FakeTensorMode(allow_non_fake_inputs=True):  # meta -> fake: shapes, no storage
        materialize(pm, torch.device("cpu"), None)
        # the optimizer as the GPU run builds it (fused AdamW), not as this CPU would
        optimizer = _build_optimizer(pm, cfg, cfg.optim.lr or 1e-4,  # lr 0: no Muon work
                                     optimizer_device(layout))
        params = pm.parameters()
        init_optimizer_state(optimizer, params, measure=False)
        _warm_step(optimizer, params)
        unreduced = _earlier_gradients(pm, cfg, layout, params)
        k = inflight_chunks(layout.pp_schedule, layout.pp, layout.virtual_stages,
                            layout.microbatches, pp_rank)
        inputs = [[_stage_input(p, cfg, layout, policy) for p in pm.parts] for _ in range(k)]
        tracker = MemTracker()
        tracker.track_external(*pm.parts, optimizer, *(x for xs in inputs for x in xs))
        # one process: autocast, as the trainer's step (a no-op otherwise)
        with untracked_sharding_propagation(), tracker, pm.autocast():
            _measured_micro_batches(pm, inputs, cfg, layout, policy, tracker, unreduced)
        step_peak = tracker.get_tracker_snapshot("peak")
        before = _bytes(tracker.get_tracker_snapshot("current"))
        # entered again, its peak starts from what the step starts with
        with untracked_sharding_propagation(), tracker:
            optimizer.step()
        opt_peak = _bytes(tracker.get_tracker_snapshot("peak"))
        optimizer.zero_grad(set_to_none=True)
    return {"step_peak_bytes": _bytes(step_peak), "step_peak_by_kind": _by_kind(step_peak),
            "optimizer_step_start_bytes": before, "optimizer_step_peak_bytes": opt_peak,
            "optimizer_step_transient_bytes": opt_peak - before}


def predicted(cfg: Config, layout: Layout, pp_rank: int, tp_rank: int) -> dict:
    """The planner's numbers for this rank (CPU: no CUDA context, no fragmentation): each
    phase of the step (planning/phases.py); the forward/backward peak is the largest of
    the backward's phases, the optimizer step's peak its own phase."""
    sp = rank_params(cfg.model, layout, pp_rank, tp_rank)
    pb = dtype_bytes(cfg.precision.param_dtype)
    rm = rank_memory(cfg, layout, pp_rank, device="cpu")
    parts, phases = rm.parts, rm.phases
    auto = autocasts(layout, cfg.precision.compute_dtype != cfg.precision.param_dtype)
    step_phase = max((k for k in phases if k != "optimizer step"),
                     key=lambda k: sum(phases[k].values()))
    return {
        "local_param_bytes": pb * sp.local,
        "local_grad_bytes": parts.get("gradients", 0),
        "local_optimizer_bytes": parts.get("optimizer state", 0),
        "memory_by_part": {k: int(v) for k, v in parts.items()},
        "step_peak_phase": step_phase,
        "step_peak_by_part": {k: int(v) for k, v in phases[step_phase].items()},
        "step_peak_by_kind": {k: int(v) for k, v in by_kind(phases[step_phase], auto,
                                                                  step_phase).items()},
        # parallel.offload=params: on the host, where this CPU's simulation holds them too
        "host_by_kind": {k: int(v) for k, v in by_kind(
            {k: v for k, v in rm.host.items() if k != "gradients" or rm.grads_held}).items()},
        "step_peak_bytes": int(sum(phases[step_phase].values())),
        "optimizer_step_peak_bytes": int(sum(phases["optimizer step"].values())),
        "optimizer_step_transient_bytes": int(parts.get("optimizer step transient", 0)),
    }


def compare(result: dict) -> dict[str, float | None]:
    """measured / planner for each peak the fake step measured (None: the planner says 0)."""
    pred = result["predicted"]
    return {k: (round(result[k] / pred[k], 3) if pred[k] else None)
            for k in ("step_peak_bytes", "optimizer_step_peak_bytes",
                      "optimizer_step_transient_bytes") if k in result}


def cpu_stand_in(cfg: Config) -> Config:
    """``cfg`` as this CPU can run it with the same tensors: flash-attn and flex (GPU kernels) as
    SDPA, whose memory is also O(sequence); fp8 emulated (the same Float8Linear modules and
    shards); blocks eager (torch's memory tracker is a dispatch mode, which compile cannot
    run under; the checkpoint policy, not compile, decides what is kept), so no async TP
    (a compiler pass over the same collectives and matmuls)."""
    if cfg.model.attention in ("flash", "flex"):  # flex: a GPU kernel too
        cfg = replace(cfg, model=replace(cfg.model, attention="sdpa"))
    if cfg.precision.fp8:
        cfg = replace(cfg, precision=replace(cfg.precision, fp8_allow_emulation=True))
    return replace(cfg, train=replace(cfg.train, compile=False),
                   parallel=replace(cfg.parallel, async_tp=False))


def _initialise(cfg: Config, layout: Layout, mesh, policy: Policy, attention: str) -> dict:
    """This rank's real shards and optimizer state, initialised and measured."""
    pm = _build(cfg, layout, mesh, policy, attention)
    t0 = time.perf_counter()
    materialize(pm, torch.device("cpu"), cfg.train.seed)
    init_seconds = time.perf_counter() - t0
    params = pm.parameters()
    optimizer = _build_optimizer(pm, cfg, cfg.optim.lr)
    t0 = time.perf_counter()
    grad_bytes = init_optimizer_state(optimizer, params)
    return {"stages": pm.stage_ids, "local_param_bytes": _storage_bytes(params),
            "local_grad_bytes": grad_bytes,
            "local_optimizer_bytes": optimizer_bytes(optimizer),
            "init_seconds": round(init_seconds, 3),
            "optimizer_init_seconds": round(time.perf_counter() - t0, 3)}


def simulate(cfg: Config, world_size: int, rank: int, step: bool = True,
             initialise: bool = True) -> dict:
    """Start rank ``rank`` of a ``world_size``-process run of ``cfg`` in this process
    (``initialise=False``: the fake step alone, no real shards or optimizer state)."""
    from pretrain.model.attention import resolve_backend

    if not 0 <= rank < world_size:
        raise ValueError(f"--rank={rank} is not a rank of a {world_size}-process world "
                         f"(0..{world_size - 1})")
    t_start = time.perf_counter()
    # One thread, as torchrun gives each rank (OMP_NUM_THREADS=1): init_seconds is what a
    # rank takes, and a busy CPU does not make OpenMP teams spin-wait over tiny tiles.
    torch.set_num_threads(1)
    device = torch.device("cpu")
    attention_asked, compiled = cfg.model.attention, cfg.train.compile
    cfg = cpu_stand_in(cfg)
    policy = resolve_policy(cfg.precision, device)
    attention = resolve_backend(cfg.model.attention, device, policy.compute_dtype,
                                cfg.model.attention_mask == "document")
    layout = resolve_layout(cfg, world_size)
    dist.init_process_group("fake", store=torch_compat.private("FakeStore")(), rank=rank,
                            world_size=world_size)
    try:
        mesh = build_mesh(layout, device)
        coord = dict(zip(mesh.root.mesh_dim_names, mesh.root.get_coordinate(), strict=True))
        result = {
            "world_size": world_size, "rank": rank, "coordinate": coord,
            "layout": layout.describe(), "precision": cfg.precision.name,
            "attention": attention,
            "predicted": predicted(cfg, layout, coord["pp"], coord["tp"]),
        }
        if initialise:
            result.update(_initialise(cfg, layout, mesh, policy, attention))
        if attention_asked == "flash":
            result["attention_note"] = "flash is a GPU kernel: simulated with sdpa"
        if compiled:
            result["compile_note"] = "blocks run eager here (train.compile=true on the GPU)"
        if step:
            result.update(fake_step(cfg, layout, mesh, policy, attention, coord["pp"]))
            result["measured_over_planner"] = compare(result)
    finally:
        dist.destroy_process_group()
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    return result
