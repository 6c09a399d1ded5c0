"""Turn a meta-device GPT into this rank's share of the model, in the order that composes:

fp8 conversion -> pipeline split -> tensor (+ sequence) parallel -> activation checkpointing
-> compile -> FSDP2 / replicate, all on the meta device (no memory), then materialise:
allocate the local shards and initialise them (each rank draws only its own shards' values,
which are those of the same elements in one process: see initialization.py).

Compile: one process compiles the model *and its loss* as one graph (``train_loss``, as
nanoGPT compiles its loss inside the forward): inductor fuses the casts, the norms, the
head and the cross-entropy, and the fp32 logits never exist. Under FSDP2 / TP each block
compiles on its own (the wrapper's hooks run between blocks; torchtitan's way) and the loss
separately, where its logits are a plain tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from pretrain.config.schema import Config
from pretrain.model.gpt import GPT, set_attention_backend
from pretrain.model.loss import cross_entropy, loss_terms
from pretrain.model.moe import GroupedExperts, MoE
from pretrain.parallel.activation_checkpoint import apply_activation_checkpointing
from pretrain.parallel.data_parallel import apply_data_parallel, autocasts, needs_wrapper
from pretrain.parallel.expert_parallel import apply_expert_parallel
from pretrain.parallel.grad_clip import clip_grad_norm, global_grad_norm
from pretrain.parallel.layout import Layout
from pretrain.parallel.mesh import Meshes, all_reduce
from pretrain.parallel.pipeline import split_model
from pretrain.parallel.tensor_parallel import apply_tensor_parallel, enable_async_tp
from pretrain.parallel.tied import TiedEmbedding, tied_embedding
from pretrain.precision.policy import Policy

# (logits or hidden states, targets) -> (loss terms): the loss the layout computes
Terms = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ParallelModel:
    """This rank's model chunks, and the answers about them that depend on the layout.

    ``parts`` is one GPT without pipeline parallelism, else this rank's pipeline stages
    (``stage_ids``). Whatever asks how the model is spread (which ranks hold the loss, which
    parameters are copies, over which group a norm is summed) asks here, so the trainer and
    its services never do."""

    parts: list[nn.Module]
    layout: Layout
    device: torch.device
    mesh: Meshes | None = None
    stage_ids: list[int] = field(default_factory=lambda: [0])
    tied: TiedEmbedding | None = None
    # one process under mixed precision: the matmuls' dtype under torch.autocast
    autocast_dtype: torch.dtype | None = None
    # (logits, targets) -> mean loss: compiled when the run compiles and the logits are a
    # plain tensor (``compiled_loss``); the pipeline schedule's loss calls it too
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    # (tokens, targets) -> mean loss of one micro batch through the whole model: model and
    # loss compiled as one graph on one process (``whole_model_loss``)
    train_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # train.z_loss > 0: training steps take (cross-entropy, z-loss term) from ``terms``
    # ((logits, targets), as ``loss``) or ``train_terms`` ((tokens, targets), as
    # ``train_loss``); evaluation keeps the plain loss
    z_loss: float = 0.0
    terms: Terms | None = None
    train_terms: Terms | None = None

    def autocast(self, enabled: bool = True) -> AbstractContextManager:
        """The compute-dtype context of forwards (one process, mixed precision), a no-op
        otherwise. Entered once around a whole step, autocast's cache casts each weight
        once per step, not once per micro batch; ``enabled=False`` nested inside it (for
        backward) keeps that cache."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=enabled)

    def micro_batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro batch through this rank's whole model (no pipeline)."""
        if self.train_loss is not None:
            return self.train_loss(x, y)
        return self.loss(self.parts[0](x), y)

    def micro_batch_terms(self, x: torch.Tensor, y: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A training micro batch's (mean loss, z-loss term; None without z-loss, whose
        path is exactly ``micro_batch_loss``'s)."""
        if not self.z_loss:
            return self.micro_batch_loss(x, y), None
        if self.train_terms is not None:
            return self.train_terms(x, y)
        return self.terms(self.parts[0](x), y)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.layout.n_stages - 1 in self.stage_ids

    @property
    def pp_group(self):
        """The pipeline's process group (None without pipeline parallelism)."""
        return self.mesh.pp.get_group() if self.mesh is not None and self.layout.pp > 1 else None

    @property
    def param_device(self) -> torch.device:
        """Where the parameter shards, gradients and optimizer state live: the host when
        FSDP2 offloads them, else the run's device."""
        return torch.device("cpu") if self.layout.offload == "params" else self.device

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
        """Every part in training (or eval) mode: a walk over every module, taken only
        when the mode changes (not on every step)."""
        if any(part.training != mode for part in self.parts):
            for part in self.parts:
                part.train(mode)

    def clip_grad_norm(self, max_norm: float, unscale=None) -> torch.Tensor:
        """Make the gradients whole (a weight tied across pipeline stages gets the sum of
        its copies' gradients), then ``unscale()`` (fp16's scaler, when given), then clip
        them to a global norm of ``max_norm`` (inf: no clipping); returns their global
        norm before clipping, on the device."""
        if self.tied is not None:
            self.tied.sync_grads()
        if unscale is not None:
            unscale()
        return clip_grad_norm(self.parameters(), max_norm, self.pp_group, self.duplicate_params,
                              device=self.device)

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared global norm of the gradients held now (every DP, TP and pipeline
        shard, each tied weight once); a device tensor, no host sync."""
        params = [p for p in self.parameters() if id(p) not in self.duplicate_params]
        return global_grad_norm(params, self.pp_group, self.device).float() ** 2

    def sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over DP ranks of a value the last pipeline stage holds (every TP rank
        holds the same), onto every rank: one all-reduce over the world, the other ranks
        adding zero. Every rank must call it at the same point."""
        if self.mesh is None:
            return value
        share = (
            value.float() / self.layout.tp
            if self.has_last_stage
            else torch.zeros(value.shape, device=self.device)
        )
        return all_reduce(share.clone())

    def sum_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over the data-parallel ranks of a value each rank holds for its own part
        of the model (a stage's MoE token counts; every TP rank holds the same): one
        all-reduce over the DP group, not the world, so each stage sums its own layers."""
        if self.mesh is None or self.layout.dp == 1:
            return value
        return all_reduce(value.float().clone(), group=self.mesh.dp.get_group())

    def gather_over_stages(self, local: dict) -> dict:
        """Every pipeline stage's ``local`` entries, on every rank (a host exchange over
        the pipeline group: for logging steps only)."""
        if self.pp_group is None:
            return local
        every: list[dict | None] = [None] * self.layout.pp
        dist.all_gather_object(every, local, group=self.pp_group)
        return {k: v for part in every for k, v in part.items()}


def parallelize(model: GPT, cfg: Config, layout: Layout, mesh: Meshes | None,
                device: torch.device, policy: Policy, cuda_graphs: bool = False
                ) -> ParallelModel:
    """Apply every parallelism to ``model`` (on the meta device); nothing is allocated.
    ``mesh`` None: one process without a process group, which only ``Layout.one_device``
    may be (``train_module.join`` makes the group otherwise). ``cuda_graphs``: the training
    loss (model + loss, one graph) replayed as a CUDA graph (planning/graphs.py decides)."""
    if mesh is None and not layout.one_device:
        raise ValueError(
            f"{layout.describe()} needs FSDP2 (parallel.offload, or several processes) and so "
            "a device mesh, even for one process: join a process group first "
            "(train_module.join)")
    sharded = mesh is not None and layout.dp > 1 and layout.dp_spec.shards
    if policy.fp8:
        from pretrain.precision.fp8 import convert_to_fp8

        convert_to_fp8(model, policy.fp8_recipe, policy.fp8_filter, emulate=policy.fp8_emulate,
                       fsdp_all_gather=sharded)
    # Tensorwise fp8 under TP: torchao's Float8 styles (activations gathered in fp8). With
    # sequence parallelism they put an fp8 tensor through a collective gloo rejects
    # ("RuntimeError: Invalid scalar type", torch 2.13), so on CPU that case gathers in bf16.
    fp8_tp = policy.fp8 and policy.fp8_recipe == "tensorwise" and (
        device.type == "cuda" or not layout.sequence_parallel)
    if mesh is not None and layout.async_tp:
        enable_async_tp(mesh.tp)
    whole = layout.one_device  # compile: model + loss, one graph
    stage_ids, parts = [0], [model]
    if mesh is not None and layout.pp > 1:
        stage_ids, parts = split_model(model, layout, mesh.pp.get_local_rank())
    for part in parts:
        if mesh is not None and layout.tp > 1:
            apply_tensor_parallel(part, mesh.tp, layout.sequence_parallel, fp8_tensorwise=fp8_tp)
        if mesh is not None and mesh.ep is not None:
            apply_expert_parallel(part, mesh.ep)
        # Checkpointing, then compile (torchtitan's order): each block compiles as one
        # graph with its checkpoint region inside (fullgraph=True: a graph break is an
        # error, not a silent slowdown), the selective policy applied by the partitioner.
        apply_activation_checkpointing(part.layers, layout.activation_checkpointing,
                                       cfg.parallel.ac_every_n_layers,
                                       mesh is not None and layout.sequence_parallel)
        if cfg.train.compile and not whole:  # regional: each block once
            for block in part.layers.values():
                compile_block(block, expert_parallel=mesh is not None and mesh.ep is not None)
        if mesh is not None and needs_wrapper(layout, policy.mixed):
            apply_data_parallel(part, list(part.layers.values()), mesh, layout, policy)
    pm = ParallelModel(parts=parts, layout=layout, device=device, mesh=mesh,
                       stage_ids=stage_ids,
                       autocast_dtype=policy.compute_dtype
                       if autocasts(layout, policy.mixed) else None)
    _losses(pm, model, cfg, whole, cuda_graphs and whole)
    if mesh is not None:
        pm.tied = tied_embedding(cfg.model.tie_embeddings, parts, stage_ids, layout, mesh.root)
    return pm


def _losses(pm: ParallelModel, model: nn.Module, cfg: Config, whole: bool,
            graphs: bool = False) -> None:
    """The loss functions ``pm`` trains and evaluates with: compiled when the run compiles
    (what Layout.compile_scope says), the z-loss terms when train.z_loss > 0; with
    ``graphs`` (one device) the training loss compiled and replayed as a CUDA graph."""
    z = pm.z_loss = cfg.train.z_loss
    if z and pm.layout.tp > 1:  # decision/checks.py says so first, unless parallel=auto chose it
        raise ValueError(f"train.z_loss={z} is not computed on vocabulary-sharded logits "
                         f"(tp={pm.layout.tp}): set train.z_loss=0 or parallel.tp=1")
    if z:
        pm.terms = functools.partial(loss_terms, z_loss=z)
    if graphs:
        pm.train_loss = whole_model_loss(model, graphs=True)
        pm.train_terms = whole_model_loss(model, z, graphs=True) if z else None
    if not cfg.train.compile:
        return
    if whole and not graphs:
        pm.train_loss = whole_model_loss(model)
        pm.train_terms = whole_model_loss(model, z) if z else None
    elif pm.layout.tp == 1:  # under TP the logits are vocabulary-sharded (loss_parallel)
        pm.loss = compiled_loss()
        pm.terms = compiled_loss(z) if z else None


def forward_and_loss(model: nn.Module, z_loss: float | None = None) -> Callable:
    """(tokens, targets) -> mean loss through ``model``: what ``whole_model_loss`` compiles
    (tests/test_compile_graphs.py traces it); with ``z_loss``, -> (loss, z-loss term)."""

    def train_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy(model(x), y, fused=True)

    def train_terms(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_terms(model(x), y, fused=True, z_loss=z_loss)

    return train_loss if z_loss is None else train_terms


def whole_model_loss(model: nn.Module, z_loss: float | None = None,
                     graphs: bool = False) -> Callable:
    """The model and its loss compiled as one graph. The loss is torch's own cross-entropy
    on the whole logits: inside the graph inductor fuses the upcast, the log-sum-exp and
    the gradient, so no fp32 copy of the logits is ever stored (what the eager path chunks
    to avoid). With ``z_loss``: (loss, z-loss term), from the same graph. ``graphs``: the
    forward and backward replayed as CUDA graphs (``cuda_graphed``)."""
    fn = forward_and_loss(model, z_loss)
    return cuda_graphed(fn) if graphs else _compiled(fn)


def compiled_loss(z_loss: float | None = None) -> Callable:
    """The cross-entropy (with ``z_loss``: its terms) compiled on its own (per-block
    compile: FSDP2, pipeline stages)."""
    if z_loss is None:
        return _compiled(functools.partial(cross_entropy, fused=True))
    return _compiled(functools.partial(loss_terms, fused=True, z_loss=z_loss))


def _compiled(fn: Callable) -> Callable:
    """fullgraph: a graph break is an error, not a silent slowdown; static shapes: a
    measuring step's halves or an evaluation batch compile graphs of their own rather than
    turning the training graph dynamic."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def cuda_graphed(fn: Callable) -> Callable:
    """``fn`` compiled with ``mode="reduce-overhead"``: inductor's kernels captured by
    cudagraph trees (forward and backward) and replayed, inputs copied into static buffers;
    static shapes and fullgraph as ``_compiled``. Each call marks a new step, so a micro
    batch's replay may reuse the memory of the last one's outputs, which the step has
    consumed by then: its loss summed on the device, its gradients added into ``.grad``
    tensors that stay allocated under graphs (``TrainModule.keep_grads``; kept as the
    replay's own output, the next replay overwrote them on an H200). On the CPU inductor
    skips the graphs and this is ``_compiled`` (tests/test_cuda_graphs.py)."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")

    def replay(*args: torch.Tensor):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args)

    return replay


def compile_block(block: nn.Module, expert_parallel: bool) -> None:
    """Compile a transformer block in place (its parameter names unchanged) as one graph.
    An MoE block under expert parallelism reads its all-to-all split sizes on the host,
    which no full graph holds: there (torchtitan's way) its attention and shared experts
    compile whole instead, and the norms, the routing, the token dispatch, the routed
    experts and the combine run eager."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    if not (expert_parallel and any(isinstance(m, GroupedExperts) for m in inner.modules())):
        block.compile(fullgraph=True)
        return
    parts = [c for c in inner.children() if not isinstance(c, MoE)]
    parts += [c.shared for c in inner.children() if isinstance(c, MoE)]
    for part in parts:  # torch's own leaf modules (norms, the router) stay eager: dynamo
        if type(part).__module__.startswith("pretrain."):  # skips their frames
            part.compile(fullgraph=True)


def parallelize_gpt(cfg: Config, layout: Layout, mesh: Meshes | None, device: torch.device,
                    policy: Policy, attention: str, cuda_graphs: bool = False) -> ParallelModel:
    """This rank's share of ``cfg.model`` (attention kernel ``attention``), built on the
    meta device and parallelised: nothing allocated yet (see ``materialize``)."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    set_attention_backend(model, attention, device)
    return parallelize(model, cfg, layout, mesh, device, policy, cuda_graphs)


@torch.no_grad()
def materialize(pm: ParallelModel, device: torch.device, seed: int | None) -> None:
    """Allocate this rank's shards on ``device`` and initialise them from ``seed``.

    Each rank draws only the values of its own shards (``GPT.init_weights``: a pure
    function of seed, name and global shape), so start-up memory is O(shard) and every
    layout starts from the weights one process would. ``seed`` None allocates without
    initialising, for a run about to load a checkpoint over them.
    """
    for part in pm.parts:
        part.to_empty(device=pm.param_device)  # the host, when FSDP2 offloads them
        part.tie_weights()
        if seed is not None:
            part.init_weights(seed)
        else:  # buffers: RoPE is computed, never saved; a checkpoint overwrites the rest
            part.init_buffers()
        if pm.param_device != device:  # buffers stay beside the compute
            _move_buffers(part, device)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, buf.to(device))  # a registered buffer keeps its persistence
