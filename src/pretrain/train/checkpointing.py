"""A run's checkpoints as the loop uses them (checkpoint/ holds the format, the manager and
the resume decisions): this run's manager, checked for room before any work, where the run
continues from, and what each save holds: the trainer's progress (a DCP ``Stateful``), the
model and optimizer, and meta.json (step, tokens, layout, config, a cooldown's source, and
each hook's state under the hook's name)."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from pretrain.checkpoint.manager import CheckpointManager
from pretrain.checkpoint.model_state import ModelOptimizer
from pretrain.checkpoint.resume import branch_record, load_weights, resume_path
from pretrain.config.schema import Config
from pretrain.planning.memory import checkpoint_bytes

log = logging.getLogger("pretrain")


class Checkpointing:
    """Found before the model exists: a resumed run skips initialising it."""

    def __init__(self, cfg: Config, run_dir: Path, device, keep_steps=()):
        self.cfg = cfg
        self.manager = CheckpointManager(Path(run_dir) / "checkpoints", cfg.checkpoint, device,
                                         keep_steps=keep_steps)
        self.manager.check_room(checkpoint_bytes(cfg))  # writable, room for one: before work
        self.resume_from = resume_path(cfg, run_dir)
        self.branch = branch_record(cfg, run_dir, self.resume_from)  # a cooldown's source

    @staticmethod
    def state(trainer) -> dict:
        return {"model_optim": ModelOptimizer(trainer.module.parts, trainer.module.optimizer),
                "train": trainer}

    def resume(self, trainer) -> None:
        """Continue from ``resume_path``'s answer (the hooks' states too: a hook newer than
        the checkpoint starts fresh); else start a new run, from load_weights_only's
        weights when given."""
        path = self.resume_from
        if path is not None:
            meta = CheckpointManager.load(path, self.state(trainer))
            for hook in trainer.hooks:
                if hook.name in meta:
                    hook.load_state_dict(meta[hook.name])
            log.info("resumed from %s: step %d, %s tokens seen (saved with layout %s)",
                     path, trainer.step,
                     f"{trainer.tokens:,}", meta.get("layout"))
        elif self.cfg.checkpoint.load_weights_only:
            load_weights(self.cfg.checkpoint.load_weights_only, self.cfg, trainer.module.parts,
                         trainer.decision.attention)

    def save(self, trainer, block: bool = False) -> None:
        """A checkpoint of this step, unless the last step was skipped for a non-finite loss
        or gradient: no save then, so retention keeps the good ones (periodic, stop and
        final saves alike)."""
        skipping = trainer.module.nonfinite_in_a_row
        if skipping:
            log.warning("step %d: no checkpoint while steps are being skipped for a "
                        "non-finite loss or gradient (%d in a row): the newest one, %s, "
                        "stays the last good one", trainer.step, skipping, self.manager.latest())
            return
        meta = {"step": trainer.step, "tokens": trainer.tokens,
                "samples_seen": trainer.samples_seen, "layout": trainer.layout.as_dict(),
                "world_size": trainer.world_size, "branch": self.branch,
                "config": OmegaConf.to_container(OmegaConf.structured(self.cfg)),
                **{h.name: state for h in trainer.hooks if (state := h.state_dict())}}
        self.manager.save(trainer.step, self.state(trainer), meta, block=block)
