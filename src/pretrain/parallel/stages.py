"""Which pipeline stages a rank runs and which blocks each stage holds: pure arithmetic on
the layout, shared by the pipeline split (parallel/pipeline.py), the tied-embedding group
(parallel/tied.py) and the planner (planning/params.py, planning/memory.py, planning/
cost.py), which must not import torch's pipelining internals to count a stage."""

from __future__ import annotations

from pretrain.parallel.layout import Layout


def stage_indices(layout: Layout, pp_rank: int) -> list[int]:
    """The global stage indices this pipeline rank runs, in execution order (stage 0, the
    whole model, without a pipeline): one stage (GPipe, 1F1B), ``virtual_stages`` stages
    round-robin (interleaved 1F1B) or two in a V (ZBV: rank r holds stages r and
    2*pp-1-r, so the first and last stage share rank 0)."""
    if layout.pp == 1:
        return [0]
    if layout.pp_schedule == "zbv":
        return [pp_rank, 2 * layout.pp - 1 - pp_rank]
    return [pp_rank + v * layout.pp for v in range(layout.virtual_stages)]


def stage_layers(n_layer: int, stage: int, n_stages: int) -> range:
    """The global indices of the transformer blocks stage ``stage`` of ``n_stages`` runs
    (balanced by count; validation requires n_layer % n_stages == 0). Stage 0 also holds
    the embeddings, the last stage the final norm and the head (``pipeline.split_stage``)."""
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)
