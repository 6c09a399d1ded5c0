"""A mixture's weights: its sources in order, the weights over the run's steps (the stages
the decision step records in config/decision.RunDecision), and what those weights take
from each source over a budget (the plan's per-source shares, exact per-batch counts from
the mixer)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pretrain.config.decision import SourceShare, WeightStage
from pretrain.config.schema import DataConfig
from pretrain.data.mixer import BatchMixer
from pretrain.data.prepare import INDEX, load_index


def mixture_sources(cfg: DataConfig) -> list[tuple[str, Path, float]]:
    """(name, prepared path, weight) per source, in the order listed: the validation of
    every source (``TokenWindows(path, "validation", ...)``) iterates this."""
    return [(s.name, Path(cfg.root) / s.name, float(s.weight)) for s in cfg.mixture]


def weight_stages(cfg: DataConfig, decay_start: int | None = None
                  ) -> tuple[WeightStage, ...]:
    """The weights of each stage, in step order: the mixture's weights from step 0, each
    data.stages entry from its step, data.cooldown_weights from ``decay_start`` (a WSD
    schedule's). Step k's batch is the (k+1)-th optimizer step's."""
    names = [s.name for s in cfg.mixture]
    stages = {0: tuple(float(s.weight) for s in cfg.mixture)}
    for st in cfg.stages:
        stages[int(st.step)] = tuple(float(st.weights.get(n, 0.0)) for n in names)
    if cfg.cooldown_weights and decay_start is not None:
        stages[int(decay_start)] = tuple(float(cfg.cooldown_weights.get(n, 0.0))
                                         for n in names)
    return tuple(WeightStage(step, w) for step, w in sorted(stages.items()))


def prepared_tokens(path: Path) -> int | None:
    """The training tokens prepared at ``path`` (None: nothing prepared there yet)."""
    if not (path / INDEX).exists():
        return None
    return int(load_index(path)["splits"]["train"]["tokens"])


def source_shares(cfg: DataConfig, stages: Sequence[WeightStage], batch: int, steps: int,
                  seq_len: int) -> tuple[SourceShare, ...]:
    """Per source: its weights, the tokens ``steps`` batches take from it (exact counts),
    its prepared size."""
    samples = BatchMixer(stages, batch, cfg.seed).before(steps)
    return tuple(SourceShare(name, tuple(st.weights[k] for st in stages),
                             int(samples[k]) * seq_len, prepared_tokens(path))
                 for k, (name, path, _) in enumerate(mixture_sources(cfg)))
