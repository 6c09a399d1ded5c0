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
from pretrain.parallel.layout import Layout, resolve_layout
from pretrain.parallel.mesh import build_mesh
from pretrain.parallel.tensor_parallel import loss_context
from pretrain.planning.memory import rank_memory
from pretrain.planning.params import rank_params
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


def _forward_backward(part: GPT, x: torch.Tensor, cfg: Config, layout: Layout,
                      policy: Policy) -> None:
    """One micro batch through one stage and back: the real loss on the last stage, a sum
    of the output (standing in for the next stage's gradient) elsewhere."""
    with loss_context(layout.tp):
        out = part(x)
        if part.lm_head is not None:
            targets = torch.randint(0, cfg.model.vocab_size,
                                    (layout.micro_batch_size, cfg.model.seq_len))
            loss = cross_entropy(out, targets)
        else:
            local = out.to_local() if isinstance(out, DTensor) else out
            loss = local.float().sum()
        loss.backward()


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


def fake_step(cfg: Config, layout: Layout, mesh, policy: Policy, attention: str) -> dict:
    """One training step of this rank on a fake copy of its model (nothing allocated), as
    a step after the first holds it: the optimizer's state exists before the step begins.
    Measured apart, with torch's MemTracker: the peak of one micro batch's forward and
    backward through each of the rank's stages (when a step has several micro batches, one
    after the first: the gradients it accumulates into exist), and the peak of the
    optimizer step that follows (whose excess over what the step starts with is its
    transient: Muon's gathered matrices and Newton-Schulz's working set). A pipeline keeps
    several micro batches in flight; this measures one (the planner's ``inflight_chunks``
    multiplies by the schedule's count)."""
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
        if layout.microbatches > 1:  # a later micro batch of the step: the earlier ones'
            for p in params:  # gradients are held (accumulated into) through its backward
                p.grad = torch.zeros_like(p)
        inputs = [_stage_input(p, cfg, layout, policy) for p in pm.parts]
        tracker = MemTracker()
        tracker.track_external(*pm.parts, optimizer, *inputs)
        # one process: autocast, as the trainer's step (a no-op otherwise)
        with untracked_sharding_propagation(), tracker, pm.autocast():
            for part, x in zip(pm.parts, inputs, strict=True):
                _forward_backward(part, x, cfg, layout, policy)
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


# What a step holds when its optimizer steps (activations and FSDP's unsharded copies gone)
AT_OPTIMIZER_STEP = ("parameters", "gradients", "optimizer state", "optimizer step transient")


def predicted(cfg: Config, layout: Layout, pp_rank: int, tp_rank: int) -> dict:
    """The planner's numbers for this rank (CPU: no CUDA context, no fragmentation). Its
    total adds the optimizer step's transient to the forward/backward peak, though the two
    never coincide (the activations are freed when the optimizer steps): the forward and
    backward peak is the total less that transient, the optimizer step's peak the parts
    ``AT_OPTIMIZER_STEP``."""
    sp = rank_params(cfg.model, layout, pp_rank, tp_rank)
    pb = dtype_bytes(cfg.precision.param_dtype)
    parts = rank_memory(cfg, layout, pp_rank, device="cpu").parts
    transient = parts.get("optimizer step transient", 0)
    return {
        "local_param_bytes": pb * sp.local,
        "local_grad_bytes": parts.get("gradients", 0),
        "local_optimizer_bytes": parts.get("optimizer state", 0),
        "memory_by_part": {k: int(v) for k, v in parts.items()},
        "step_peak_bytes": int(sum(parts.values()) - transient),
        "optimizer_step_peak_bytes": int(sum(parts.get(k, 0) for k in AT_OPTIMIZER_STEP)),
        "optimizer_step_transient_bytes": int(transient),
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


def simulate(cfg: Config, world_size: int, rank: int, step: bool = True) -> dict:
    """Start rank ``rank`` of a ``world_size``-process run of ``cfg`` in this process."""
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
        pm = _build(cfg, layout, mesh, policy, attention)
        t0 = time.perf_counter()
        materialize(pm, device, cfg.train.seed)
        init_seconds = time.perf_counter() - t0
        params = pm.parameters()
        optimizer = _build_optimizer(pm, cfg, cfg.optim.lr)
        t0 = time.perf_counter()
        grad_bytes = init_optimizer_state(optimizer, params)
        result = {
            "world_size": world_size, "rank": rank, "coordinate": coord,
            "layout": layout.describe(), "stages": pm.stage_ids,
            "precision": cfg.precision.name, "attention": attention,
            "local_param_bytes": _storage_bytes(params),
            "local_grad_bytes": grad_bytes,
            "local_optimizer_bytes": optimizer_bytes(optimizer),
            "init_seconds": round(init_seconds, 3),
            "optimizer_init_seconds": round(time.perf_counter() - t0, 3),
            "predicted": predicted(cfg, layout, coord["pp"], coord["tp"]),
        }
        if attention_asked == "flash":
            result["attention_note"] = "flash is a GPU kernel: simulated with sdpa"
        if compiled:
            result["compile_note"] = "blocks run eager here (train.compile=true on the GPU)"
        del optimizer, params, pm
        if step:
            result.update(fake_step(cfg, layout, mesh, policy, attention))
            result["measured_over_planner"] = compare(result)
    finally:
        dist.destroy_process_group()
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    return result
