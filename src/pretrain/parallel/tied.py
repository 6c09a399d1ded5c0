"""An embedding tied to the output head when a pipeline puts them on different stages.

GPT-2/3 share the token embedding with the output matrix. Split into stages, the first stage
holds the embedding and the last the head: two copies, initialised equal. As in Megatron-LM
(its "embedding group"), their gradients are summed after backward, so both copies receive
the gradient of the tied weight and the identical optimizer steps keep them equal. The
gradient norm counts the head's copy zero times (it is the embedding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pretrain.parallel.layout import Layout
from pretrain.parallel.stages import stage_indices


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TiedEmbedding:
    """The copies of the tied weight on this rank, and the group that sums their gradients
    with the copies on other pipeline ranks (None when both stages live here)."""

    def __init__(self, parts: list, stage_ids: list[int], layout: Layout, mesh: DeviceMesh):
        last = layout.n_stages - 1
        # Modules, not parameters: materialising the model replaces the parameter objects.
        self._embeddings = [p.tok_emb for p, s in zip(parts, stage_ids, strict=True) if s == 0]
        self._heads = [p.lm_head for p, s in zip(parts, stage_ids, strict=True) if s == last]
        holder = {s: r for r in range(layout.pp) for s in stage_indices(layout, r)}
        first_rank, last_rank = holder[0], holder[last]
        self.group = None
        if first_rank != last_rank:
            # One group per (dp, tp) coordinate; every rank must create all of them.
            ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, tp) -> global rank
            me = dist.get_rank()
            for coord in ranks[0].flatten().tolist():
                idx = (ranks[0] == coord).nonzero()[0].tolist()
                pair = [coord, int(ranks[(last_rank, *idx)])]
                group = dist.new_group(pair)
                if me in pair:
                    self.group = group

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """This rank's copies of the tied weight."""
        return [m.weight for m in self._embeddings + self._heads]

    @property
    def duplicates(self) -> frozenset[int]:
        """The head copies: counted zero times in the gradient norm."""
        return frozenset(id(m.weight) for m in self._heads)

    @torch.no_grad()
    def sync_grads(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        total = _local(grads[0]).clone()
        for g in grads[1:]:
            total += _local(g)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            _local(g).copy_(total)


def tied_embedding(cfg_tie: bool, parts: list, stage_ids: list[int], layout: Layout,
                   mesh: DeviceMesh | None) -> TiedEmbedding | None:
    if not cfg_tie or layout.pp == 1 or mesh is None:
        return None
    return TiedEmbedding(parts, stage_ids, layout, mesh)
