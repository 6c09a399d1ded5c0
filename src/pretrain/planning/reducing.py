"""The backward of a step whose FSDP2 groups reduce as they finish (one micro batch, or the
last of several, without a pipeline): a timeline, block by block, not one "backward end".

FSDP2 reduce-scatters a group's gradient as soon as the group's backward ends, so the
backward never holds every unsharded gradient at once. Read from the simulation's timeline
(``tools/plan.py --check-matrix``: the live tensors at the measured peak, by the op that
made them), a block's backward, ``j`` blocks from the last, holds:

- the sharded gradients of the blocks already reduced (all of them when an earlier micro
  batch or step made them);
- the weights gathered: the root's (gathered again for the head's backward and kept until
  the embeddings' ends), this block's and, under ZeRO-3, the next block's (prefetched),
  except at the first block, which has no next; ZeRO-2 keeps every weight gathered;
- the previous group's reduce-scatter input (``reduce_dtype``, the whole group: FSDP2 keeps
  it until the next reduce-scatter is issued), and the head's unsharded gradient (made by
  the head's backward, reduced with the root's group at the very end);
- the saved activations of this block and those not yet run, and a block's backward
  working set (with its recomputation) and the first gradient it makes (its MLP output
  projection's, in the compute dtype: the peak is in the MLP's backward, where the widest
  activation gradient lives; an MoE block's experts: the grouped GEMMs' backward writes the
  whole group's gradients before autograd accumulates them).

Under expert parallelism a block is two FSDP groups (``parallel.data_parallel``: the routed
experts over ``experts_fsdp``, the rest over the dp mesh), gathered, reduced and sharded
apart: the experts' backward runs first, so the dense part's reduce-scatter input is the
one held into the next block, and the experts' all-gather output is held through their
backward.

Then the root's own backward (the embeddings), after every block: the head's gradient, the
embedding's gradient (the whole vocabulary's in the compute dtype: DTensor's
``embedding_dense_backward`` has no vocabulary-sharded strategy, so under TP a rank makes
the replicated gradient and keeps a copy of its shard; tied weights add the two into a
third), the last block's reduce-scatter input. Last, ``backward end``: the root reduced,
its reduce-scatter input the only buffer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reducing:
    """What the timeline needs, bytes per rank. Per block (``blocks``, first block first):
    its gathered weights in the compute dtype, its sharded gradient, its reduce-scatter
    input, its saved activations."""

    weights: tuple[float, ...]
    expert_weights: tuple[float, ...]  # under EP: the routed experts, a group of their own
    grads: tuple[float, ...]
    reduce: tuple[float, ...]
    saved: tuple[float, ...]
    saved_rest: float  # saved outside the blocks at the blocks' backward (token ids, masks)
    root_weights: float
    root_reduce: float
    all_gathered: float  # > 0: ZeRO-2, every weight gathered through the backward
    grads_held: bool
    head_grad: float
    embedding_grad: float
    work: float  # one block's backward transient
    recompute: float = 0.0  # of which its activations made again (activation checkpointing)
    first_grad: float = 0.0  # the gradient a block's backward makes first (its MLP output's)


def _fixed(parts: dict[str, float]) -> dict[str, float]:
    keep = ("parameters", "optimizer state", "fp8 scaling state")
    return {k: (parts[k] if k in keep else 0.0) for k in (*parts, "gathered expert weights")}


def _block(parts: dict[str, float], r: Reducing, i: int) -> dict[str, float]:
    """Block ``i``'s backward (blocks run backward from the last)."""
    n = len(r.weights)
    done = range(i + 1, n)
    # the all-gather output of the group gathered last: the next block's first group in
    # backward (prefetched), or at the first block an MoE block's experts (its dense part
    # comes after them)
    buffer = (r.expert_weights[i - 1] or r.weights[i - 1]) if i > 0 else r.expert_weights[i]
    gathered = r.all_gathered or r.root_weights + r.weights[i] + buffer
    return {**_fixed(parts),
            "gathered expert weights": 0.0 if r.all_gathered else r.expert_weights[i],
            "gradients": r.first_grad + (parts["gradients"] if r.grads_held
                                         else sum(r.grads[k] for k in done)),
            "compute-dtype weight copies": gathered,
            # an expert group's gradients: the grouped GEMMs' backward writes them whole
            "gradient buffers": r.head_grad + (r.reduce[i + 1] if i + 1 < n else 0.0)
            + r.expert_weights[i],
            "activations": r.saved_rest + sum(r.saved[: i + 1]) + r.recompute,
            "backward transient": r.work - r.recompute}


def reducing_phases(parts: dict[str, float], r: Reducing) -> dict[str, dict[str, float]]:
    """``blocks backward`` (its largest block), ``root backward`` and ``backward end``, each
    with ``parts``' names (0 where the phase holds none of it)."""
    blocks = max((_block(parts, r, i) for i in range(len(r.weights))),
                 key=lambda held: sum(held.values()), default=_fixed(parts))
    grads = parts["gradients"] if r.grads_held else sum(r.grads)
    root = {**_fixed(parts), "gradients": grads,
            "compute-dtype weight copies": r.all_gathered or r.root_weights,
            "gradient buffers": r.head_grad + (r.reduce[0] if r.reduce else 0.0),
            "backward transient": r.embedding_grad, "gathered expert weights": 0.0}
    end = {**_fixed(parts), "gradients": parts["gradients"], "gradient buffers": r.root_reduce,
           "gathered expert weights": 0.0}
    phases = {"blocks backward": blocks, "root backward": root, "backward end": end}
    return {name: {k: v for k, v in held.items() if k in parts or v}
            for name, held in phases.items()}
