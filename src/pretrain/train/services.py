"""The services the loop calls through its seam (``hooks.Hook``), one line each, in the
order the loop calls them at each point. A new service is a ``Hook`` subclass in a module of
its own (in the services layer of the training wing's contract, pyproject.toml) and one line
here; the loop does not change."""

from __future__ import annotations

from typing import Any

from pretrain.checkpoint.folder import META_KEYS
from pretrain.train import downstream
from pretrain.train.evaluation import SampleHook, source_validation
from pretrain.train.expert_load import ExpertLoad
from pretrain.train.garbage import GarbageCollectionHook
from pretrain.train.hooks import Hook
from pretrain.train.noise_scale import NoiseScaleHook
from pretrain.train.spike_window import SpikeWindow

# meta.json's own keys (checkpoint/folder.py META_KEYS): a hook's state may not take one
RESERVED = META_KEYS


def build_hooks(trainer: Any) -> list[Hook]:
    """The run's services, built after the train module and before resume (a hook may read
    ``trainer.cfg``, ``trainer.module``, ``trainer.budget``, ``trainer.layout``)."""
    hooks: list[Hook | None] = [
        source_validation(trainer),  # each source's validation loss and bits per byte
        ExpertLoad(),  # MoE: routing stats on the log line, the busiest expert's load
        NoiseScaleHook(trainer.noise),  # the gradient noise scale, the batch compared to it
        GarbageCollectionHook(trainer.cfg.train.gc_interval),  # at fixed steps, every rank
        SpikeWindow(trainer.module),  # the spike guard's window across a resume
        downstream.build(trainer),  # multiple-choice task scores (eval.tasks; None: off)
        SampleHook(),  # text from the trained model at the end
    ]
    return check_names([h for h in hooks if h is not None])


def check_names(hooks: list[Hook]) -> list[Hook]:
    """Each hook's state has a key of its own in meta.json."""
    names = [h.name for h in hooks]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & RESERVED))
    if clash:
        raise ValueError(f"hook names {clash} are taken (by another hook or by meta.json's "
                         f"own keys {sorted(RESERVED)}): give each Hook a name of its own")
    return hooks
