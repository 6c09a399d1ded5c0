"""The phases of a training step, and which of the planner's parts (``memory.PARTS``) a GPU
holds in each: the step's peak is the largest phase, not the sum of every part's own peak.

- ``forward`` (a pipeline rank only, ``pipeline_phases.py``): the last forward of the
  micro batches in flight, before the backward that frees the oldest.
- ``loss backward``: the forward has ended and the loss's backward runs: every saved
  activation, the logits and loss, the loss's backward transient, the pipeline's receive
  buffers, FSDP's unsharded weights as far as they are still gathered (none under ZeRO-3,
  which reshards the root after forward too).
- ``blocks backward``: the logits freed, the head's and the blocks' weights gathered again,
  one block's backward working set (and recomputation). In both, gradients exist here only when an
  earlier micro batch (accumulation, a pipeline) or an earlier step (CUDA graphs keep
  ``.grad``: ``zero_grad(set_to_none=False)``) made them: with one micro batch and
  ``set_to_none=True`` the peak comes before any gradient exists. Where gradients
  accumulate unreduced (``offload.defers_reduction`` with a DP wrapper: DDP/ZeRO-2 no-sync,
  a pipeline), FSDP2 holds the unsharded accumulators instead and the sharded gradients do
  not exist until the last micro batch reduces them.
- ``backward end``: the gradients reduced into their shards, FSDP's per-block gradient
  buffers at their largest, no activations.
- ``optimizer step``: parameters, gradients, optimizer state and the step's transient
  (activations and FSDP's unsharded copies freed: measured, tools/plan.py --simulate).

Kinds: the categories torch's ``MemTracker`` (``tools/plan.py --simulate``) reports, each
part under the one that holds it (FSDP2's unsharded weights are the module's parameters
while a block runs).
"""

from __future__ import annotations

from dataclasses import dataclass

PHASES = ("forward", "loss backward", "blocks backward", "root backward", "backward end",
          "optimizer step")

KIND_OF = {
    "parameters": "Parameter", "compute-dtype weight copies": "Parameter",
    "fp8 scaling state": "Parameter",
    # FSDP2's all-gather outputs held (pipeline_phases.py): Activation in a forward
    "all-gather outputs": "Temp",
    "gradients": "Gradient", "gradient buffers": "Temp",
    "optimizer state": "Optstate", "optimizer step transient": "Temp",
    "activations": "Activation", "logits and loss": "Activation",
    "pipeline buffers": "Activation", "backward transient": "Temp",
    # EP's experts, gathered by their own FSDP group: the module that uses them reads the
    # weights without a forward of the experts' module, so MemTracker never tags their
    # unsharded storages as parameters, and counts them as the forward outputs they were
    "gathered expert weights": "Activation",
}
KINDS = ("Parameter", "Gradient", "Optstate", "Activation", "Temp")
# compared as one: FSDP2's gathered weights are the module's parameters once installed and
# a temporary while being gathered (or prefetched), and its gradient accumulators a temporary
COMPARED = (("Parameter", "Temp"), ("Gradient",), ("Optstate",), ("Activation",))

_ACTIVATION = ("activations", "logits and loss", "backward transient", "pipeline buffers")
_AT_OPTIMIZER_STEP = ("parameters", "gradients", "optimizer state", "optimizer step transient")


def grads_at_backward_start(earlier: bool, accumulators: bool) -> bool:
    """Whether this rank's (sharded) gradients exist when a backward starts: ``earlier``,
    an earlier micro batch or step made them and kept them (accumulation, a pipeline, CUDA
    graphs), unless they are being accumulated unreduced (``accumulators``)."""
    return earlier and not accumulators


@dataclass(frozen=True)
class Backward:
    """What the backward phases hold beyond the parts: FSDP2's unsharded gradient
    accumulators (0 unless gradients accumulate unreduced: held from the first micro
    batch's backward to the last's), whether the sharded gradients exist
    (``grads_at_backward_start``), the loss's and a block's backward transients, and the
    compute-dtype weight copies gathered while the loss's backward runs."""

    accumulators: float
    grads_held: bool
    loss_transient: float
    block_transient: float
    copies_at_loss: float


def phase_parts(parts: dict[str, float], bw: Backward) -> dict[str, dict[str, float]]:
    """Each phase's parts (the names in ``parts``, 0 where the phase holds none of it)."""
    zero = dict.fromkeys(parts, 0.0)
    start = {**parts, "optimizer step transient": 0.0,
             "gradients": parts.get("gradients", 0.0) if bw.grads_held else 0.0,
             "gradient buffers": bw.accumulators}
    loss = {**start, "backward transient": bw.loss_transient,
            "compute-dtype weight copies": bw.copies_at_loss}
    blocks = {**start, "backward transient": bw.block_transient, "logits and loss": 0.0}
    # the last micro batch's reduction turns each group's accumulator into its shard
    end = {**parts, "optimizer step transient": 0.0, **dict.fromkeys(_ACTIVATION, 0.0),
           "gradient buffers": parts.get("gradient buffers", 0.0) - bw.accumulators}
    step = {**zero, **{k: parts[k] for k in _AT_OPTIMIZER_STEP if k in parts}}
    phases = {"loss backward": loss, "blocks backward": blocks, "backward end": end,
              "optimizer step": step}
    # offloaded parts are on the host: in no phase on the GPU
    return {name: {k: v for k, v in held.items() if k in parts} for name, held in phases.items()}


def by_kind(parts: dict[str, float], autocast: bool = False, phase: str = ""
            ) -> dict[str, float]:
    """``parts`` (of ``phase``) summed by MemTracker's kinds; under autocast the weight
    copies are autocast's cache, made by the forward: activations to MemTracker, as are
    FSDP2's all-gather outputs held in the forward phase."""
    kind_of = {**KIND_OF, "compute-dtype weight copies": "Activation"} if autocast else KIND_OF
    if phase == "forward":
        kind_of = {**kind_of, "all-gather outputs": "Activation"}
    out = dict.fromkeys(KINDS, 0.0)
    for name, b in parts.items():
        if name in kind_of:
            out[kind_of[name]] += b
    return out
