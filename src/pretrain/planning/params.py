"""How many parameter elements each rank holds, exactly, for a model and a layout.

The model is read from the meta-device GPT (the same module ``budget.count_params`` counts, so
tied weights, biases, norms and vocabulary padding are all right), then each parameter is
placed the way ``pretrain.parallel`` places it:

- pipeline: stage s holds the layers ``parallel.stages.stage_layers`` gives it; stage 0
  the embeddings, the last stage the final norm and the head; ranks hold stages as
  ``parallel.stages.stage_indices`` says (the functions the pipeline split itself uses).
  A head tied to the embedding but on another stage is a second copy (Megatron's
  "embedding group", ``parallel/tied.py``).
- tensor parallel: the dimension ``parallel.tensor_parallel.tp_shard_dim`` names, the one
  the TP plan itself is built from (column-parallel and vocabulary-parallel: 0, row-parallel
  weights: 1, row-parallel biases and norms: replicated). DTensor shards like
  ``torch.chunk``: ceil(n / t) rows on the first ranks.
- FSDP2 (zero2 / zero3, over dp_shard ranks): dim 0 of the TP-local tensor, padded to
  ceil(d0 / dp_shard) rows on every rank (FSDP2 pads so all-gathers are even). DDP
  (``replicate``) keeps whole tensors.
- expert parallelism (``parallel.ep``): each MoE layer's 3-D expert tensors split along the
  experts over ep ranks, then sharded by FSDP2 along dim 1 over the dp_shard / ep ranks
  outside the EP group (``parallel.expert_parallel``, ``parallel.data_parallel``).

Rank coordinates default to 0, the rank with the largest shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from pretrain.config.schema import ModelConfig
from pretrain.optim.muon import muon_matrix
from pretrain.parallel.data_parallel import shard_dim
from pretrain.parallel.layout import Layout
from pretrain.parallel.stages import stage_indices, stage_layers
from pretrain.parallel.tensor_parallel import tp_shard_dim


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    layer: int | None  # transformer block index, None for embeddings / final norm / head
    tp_dim: int | None  # dimension TP shards, None when replicated over TP
    matmul: bool  # an nn.Linear parameter (autocast casts it; fp8 converts it)

    @property
    def expert(self) -> bool:
        """A routed expert tensor (experts x out x in), the one expert parallelism splits."""
        return ".experts." in self.name


def model_key(model: ModelConfig) -> tuple:
    """``model``'s fields as a tuple, the key of the caches below (its fields are scalars
    and enums: ``dataclasses.astuple``'s deep copy gave the same tuple at 6x the cost, 2.8 s
    of a 64-GPU ``parallel=auto`` search's 12.5)."""
    return tuple(getattr(model, f.name) for f in dataclasses.fields(model))


def inventory(model: ModelConfig) -> tuple[Param, ...]:
    """Every parameter of the whole model once; a tied head appears as ``lm_head.weight``
    only when it is a separate tensor (untied)."""
    return _inventory(model_key(model))


def linear_elements(model: ModelConfig) -> dict[str, int]:
    """Elements of the blocks' Linear weights (``matmul``: every one, routed experts
    included), of the routed experts alone (``experts``), and per Linear's name within a
    block summed over the blocks (``wq``, ``wo``, ...): what the cost model's FLOPs read,
    counted once per model, not per candidate layout."""
    return _linear_elements(model_key(model))


@functools.lru_cache(maxsize=32)
def _linear_elements(fields: tuple) -> dict[str, int]:
    out = {"matmul": 0, "experts": 0}
    for q in _inventory(fields):
        if q.layer is not None and q.matmul:
            out["matmul"] += math.prod(q.shape)
            name = q.name.split(".")[-2]
            out[name] = out.get(name, 0) + math.prod(q.shape)
        if q.expert:
            out["experts"] += math.prod(q.shape)
    return out


@functools.lru_cache(maxsize=32)
def _inventory(fields: tuple) -> tuple[Param, ...]:
    import torch

    from pretrain.model.gpt import GPT

    model = ModelConfig(*fields)
    with torch.device("meta"):
        gpt = GPT(model)
    linear = {n for n, m in gpt.named_modules() if isinstance(m, torch.nn.Linear)}
    out = []
    for name, p in gpt.named_parameters():  # tied parameters are listed once
        parts = name.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        out.append(Param(name, tuple(p.shape), layer, tp_shard_dim(name),
                         name.rpartition(".")[0] in linear))
    return tuple(out)


def shard_len(n: int, k: int, coord: int = 0) -> int:
    """Length of chunk ``coord`` when ``torch.chunk``-style sharding splits n over k."""
    size = math.ceil(n / k)
    return max(0, min(n, (coord + 1) * size) - coord * size)


def tp_local_shape(p: Param, tp: int, tp_rank: int = 0) -> tuple[int, ...]:
    if tp == 1 or p.tp_dim is None:
        return p.shape
    shape = list(p.shape)
    shape[p.tp_dim] = shard_len(shape[p.tp_dim], tp, tp_rank)
    return tuple(shape)


def fsdp_numel(shape: tuple[int, ...], dp_shard: int) -> int:
    """Elements FSDP2 allocates per rank for a tensor of ``shape``: the sharded dimension
    (``parallel.data_parallel.shard_dim``: 0, or 1 for experts the ranks do not divide)
    padded to ceil(d / dp_shard) (the same on every rank)."""
    return math.prod(fsdp_shape(shape, dp_shard))


def fsdp_shape(shape: tuple[int, ...], dp_shard: int) -> tuple[int, ...]:
    """The shape of the shard ``fsdp_numel`` counts."""
    if not shape:
        return shape
    dim = shard_dim(shape, dp_shard)
    return (*shape[:dim], math.ceil(shape[dim] / dp_shard), *shape[dim + 1:])


@dataclass(frozen=True)
class StageParams:
    """Parameter elements one rank holds for its stages. ``blocks``: per transformer block,
    its unsharded (TP-local) element count, the unit FSDP gathers; ``root``: the same for
    the rest (embeddings, final norm, head), also one FSDP unit per stage."""

    local: int  # elements this rank stores (after TP, and FSDP sharding if any)
    unsharded: int  # elements after TP only (what FSDP all-gathers, or DDP holds)
    matmul_unsharded: int  # of which nn.Linear parameters (autocast casts these)
    block_matmul: int  # of which inside transformer blocks (fp8 converts these)
    blocks: tuple[int, ...]
    root: int
    n_tensors: int  # parameter tensors (Adam keeps a step counter for each)
    n_linear: int  # Linear weights inside blocks (fp8 converts these)
    muon_local: int = 0  # of ``local``, the matrices optim=muon gives Muon (muon.muon_matrix)
    n_muon: int = 0  # how many tensors those are
    muon_largest: tuple[int, ...] = ()  # the whole (global) shape of the largest of them
    # (name, global shape, shape of this rank's shard) of every tensor: what an optimizer's
    # state is a function of (optim/specs.py OptimizerSpec.state_bytes)
    held: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    roots: tuple[int, ...] = ()  # ``root`` per stage, the rank's first stage first


@dataclass(frozen=True)
class _Sum:
    local: int = 0
    unsharded: int = 0
    matmul: int = 0
    n_tensors: int = 0
    n_linear: int = 0
    muon: int = 0
    n_muon: int = 0
    muon_largest: tuple[int, ...] = ()
    held: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()

    def add(self, p: Param, tp: int, tp_rank: int, dp_shard: int, sharded: bool, ep: int
            ) -> _Sum:
        shape = tp_local_shape(p, tp, tp_rank)
        if ep > 1 and p.expert:  # this rank's experts, FSDP-sharded on dim 1 outside EP
            shape = (shape[0] // ep, *shape[1:])
            full = math.prod(shape)
            local_shape = (shape[0], math.ceil(shape[1] / (dp_shard // ep)), *shape[2:])
        else:
            full = math.prod(shape)
            local_shape = fsdp_shape(shape, dp_shard) if sharded else shape
        local = math.prod(local_shape)
        linear = p.matmul and p.layer is not None and p.name.endswith("weight")
        muon = muon_matrix(p.name, p.shape)
        largest = max(self.muon_largest, p.shape, key=math.prod) if muon else self.muon_largest
        return _Sum(self.local + local, self.unsharded + full,
                    self.matmul + (full if p.matmul else 0), self.n_tensors + 1,
                    self.n_linear + linear, self.muon + (local if muon else 0),
                    self.n_muon + muon, largest, (*self.held, (p.name, p.shape, local_shape)))


def rank_params(model: ModelConfig, layout: Layout, pp_rank: int = 0, tp_rank: int = 0
                ) -> StageParams:
    """What pipeline rank ``pp_rank`` (TP rank ``tp_rank``) holds under ``layout``."""
    sharded = layout.dp_spec.shards and layout.dp_shard > 1
    return _rank_params(model_key(model), layout.tp, tp_rank, layout.dp_shard,
                        sharded, layout.ep, tuple(stage_indices(layout, pp_rank)),
                        layout.n_stages)


def expert_share(model: ModelConfig, layout: Layout, pp_rank: int = 0) -> int:
    """Of ``rank_params(...).unsharded``, the elements of routed experts (after EP): FSDP
    gathers and reduces them over dp_shard / ep ranks, not dp_shard."""
    return sum(block_experts(model, layout, pp_rank))


def block_experts(model: ModelConfig, layout: Layout, pp_rank: int = 0) -> tuple[int, ...]:
    """Of each of ``rank_params(...).blocks``, the routed experts' elements (after EP)."""
    params = inventory(model)
    per_layer = {p.layer: 0 for p in params if p.layer is not None}
    for p in params:
        if p.expert:
            per_layer[p.layer] += math.prod(p.shape) // layout.ep
    return tuple(per_layer[layer] for s in stage_indices(layout, pp_rank)
                 for layer in stage_layers(model.n_layer, s, layout.n_stages))


def _root_params(model: ModelConfig, params: tuple[Param, ...], first: bool, last: bool
                 ) -> list[Param]:
    """The parameters outside the blocks that a stage holds, as ``split_stage`` keeps them:
    the embeddings on the first stage (the token table also a matmul weight when it is the
    tied head as well), the final norm and an untied head on the last, and a copy of the
    tied embedding as the head on a last stage that is not the first."""
    tied = model.tie_embeddings
    out = []
    for p in params:
        top = p.name.split(".")[0]
        if p.layer is None and top in ("tok_emb", "pos_emb") and first:
            shared = p.name == "tok_emb.weight" and tied and last
            out.append(dataclasses.replace(p, matmul=p.matmul or shared))
        elif p.layer is None and top not in ("tok_emb", "pos_emb") and last:
            out.append(p)
    if last and tied and not first:
        emb = next(p for p in params if p.name == "tok_emb.weight")
        out.append(Param("lm_head.weight", emb.shape, None, 0, True))
    return out


def _sum(params: list[Param], tp: int, tp_rank: int, dp_shard: int, sharded: bool, ep: int
         ) -> _Sum:
    total = _Sum()
    for p in params:
        total = total.add(p, tp, tp_rank, dp_shard, sharded, ep)
    return total


@functools.lru_cache(maxsize=4096)
def _rank_params(fields: tuple, tp: int, tp_rank: int, dp_shard: int, sharded: bool, ep: int,
                 stages: tuple[int, ...], n_stages: int) -> StageParams:
    model = ModelConfig(*fields)
    params = inventory(model)
    shard = (tp, tp_rank, dp_shard, sharded, ep)
    # Blocks of one kind have the same parameters (dense, or MoE after the first
    # model.moe_first_dense): sum one of each kind once.
    kinds: dict[tuple, _Sum] = {}
    blocks = []
    for s in stages:
        for layer in stage_layers(model.n_layer, s, n_stages):
            mine = [p for p in params if p.layer == layer]
            kind = tuple((p.name.split(".", 2)[-1], p.shape) for p in mine)
            if kind not in kinds:
                kinds[kind] = _sum(mine, *shard)
            blocks.append(kinds[kind])
    parts = [_sum(_root_params(model, params, s == 0, s == n_stages - 1), *shard)
             for s in stages] + blocks
    total = _Sum(*(sum(getattr(part, f) for part in parts) for f in ("local", "unsharded",
                                                                      "matmul", "n_tensors",
                                                                      "n_linear", "muon",
                                                                      "n_muon")),
                 muon_largest=max((part.muon_largest for part in parts), key=math.prod),
                 held=tuple(h for part in parts for h in part.held))
    root = parts[:len(stages)]
    return StageParams(
        local=total.local,
        unsharded=total.unsharded,
        matmul_unsharded=total.matmul,
        block_matmul=sum(b.matmul for b in blocks),
        blocks=tuple(b.unsharded for b in blocks),
        root=sum(r.unsharded for r in root),
        n_tensors=total.n_tensors,
        n_linear=total.n_linear,
        muon_local=total.muon,
        n_muon=total.n_muon,
        muon_largest=total.muon_largest,
        held=total.held,
        roots=tuple(r.unsharded for r in root),
    )
