"""A pipeline rank's forward phase, and its blocks' backward under ZeRO-3: where what
FSDP2 holds differs from a single stage's step.

**The forward** (every pipeline rank): the last forward of the micro batches it holds in
flight (``activations.inflight_chunks``), where an interleaved rank peaks. A rank's
schedule runs up to ``k`` forwards before the backward that frees the oldest; the ``k``-th
runs on local stage ``(k - 1) % v`` (the chunks go round the rank's stages: Interleaved1F1B's
warm-up, and the simulation's order). Read from the simulation's live tensors at that peak
(``tools/plan.py --check-matrix``, the interleaved row: rank 0 peaks at the start of stage
0's block in its fifth forward) and from FSDP2's rules (torch 2.13,
``FSDPParamGroup.wait_for_unshard``), it holds, at the start of that stage's last block:

- the saved activations of the ``k - 1`` chunks before it (spread over the rank's stages)
  and of the running chunk's blocks before this one, the token ids and masks of all;
- under ZeRO-3 (every group resharded after its forward), only the running stage's root
  and this block gathered, and two all-gather outputs: in a forward FSDP2 keeps a group's
  output past its copy-out until the next group's copy-out (to overlap it with the next
  all-gather), so the previous group's (the root's, at a stage's first block) and this
  block's are held; made by a forward, they are Activation to MemTracker;
- otherwise every weight gathered as in the backward (ZeRO-2 and DDP keep them);
- no logits and no backward transient; the optimizer state, what earlier micro batches
  left (gradients or FSDP2's accumulators) and the receive buffers as in the backward.

**The blocks' backward under ZeRO-3**: every forward reshards its stage, so a backward
starts with its stage gathered again: at its first block (the most activations still
saved) the stage's root and that block are gathered, with the root's all-gather output
(issued as the stage's backward begins) and the next block's (prefetched) held, Temp to
MemTracker (in backward FSDP2 frees an output after its copy-out; measured on the 1F1B row:
root and block gathered, both outputs held). Taken on the local stage where that is most.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineRank:
    """Per local stage (the rank's stages, first first): one chunk's saved activations,
    its blocks, its root's and its largest block's weights gathered (compute-dtype bytes);
    ``chunks``: the micro batches in flight; ``rest``: saved beyond the blocks (token ids,
    masks) for all of them; ``resharded``: ZeRO-3, each group resharded after its forward."""

    chunks: int
    per_chunk: tuple[float, ...]
    layers: tuple[int, ...]
    roots: tuple[float, ...]
    blocks: tuple[float, ...]
    rest: float
    resharded: bool


def running_stage(pr: PipelineRank) -> int:
    """The local stage the last forward in flight runs on."""
    return (pr.chunks - 1) % len(pr.per_chunk)


def forward_phase(at_loss: dict[str, float], pr: PipelineRank) -> dict[str, float]:
    """The forward phase's parts, from the loss backward's (``phases.phase_parts``: the
    same state, gradients and buffers)."""
    s = running_stage(pr)
    before = (pr.chunks - 1) * sum(pr.per_chunk) / len(pr.per_chunk)
    running = pr.per_chunk[s] * (pr.layers[s] - 1) / max(pr.layers[s], 1)
    held = {**at_loss, "activations": before + running + pr.rest, "logits and loss": 0.0,
            "backward transient": 0.0}
    if pr.resharded:
        previous = pr.roots[s] if pr.layers[s] == 1 else pr.blocks[s]
        held["compute-dtype weight copies"] = pr.roots[s] + pr.blocks[s]
        held["all-gather outputs"] = previous + pr.blocks[s]
    return held


def blocks_backward(at_blocks: dict[str, float], pr: PipelineRank) -> dict[str, float]:
    """The blocks' backward under ZeRO-3 (``pr.resharded``), from the phase that assumes
    every weight gathered: the stage's root and first block gathered, the root's and the
    next block's all-gather outputs held, on the stage where they come to the most."""
    def held(s: int) -> tuple[float, float]:
        prefetched = pr.blocks[s] if pr.layers[s] > 1 else 0.0
        return pr.roots[s] + pr.blocks[s], pr.roots[s] + prefetched

    weights, outputs = max((held(s) for s in range(len(pr.roots))), key=sum)
    return {**at_blocks, "compute-dtype weight copies": weights, "all-gather outputs": outputs}
