"""The run as one torchft replica group of several (``ft.mode=torchft``).

The loop is trainer.py's, unchanged; this subclass wraps it from outside, as the parallel
layer wraps the model: before each step the group's quorum (parallel/replica_groups.py; a
group behind the others heals there from a live peer), after its backward the gradients
averaged over the groups present and the commit vote; a step a failed peer spoiled is taken
again (nothing was applied). Each group keeps its own run directory
(``<run>/group<N>/``: checkpoints, metrics, result), so any survivor has every file a
restart needs.

The batch while a group is away (docs/reliability.md#torchft): each group trains
``train.global_batch_size`` sequences a step, the ``group``-th slice of step ``s``'s
``ft.groups`` slices (a fixed place in the data, whoever is present), so the global batch
is that times the groups present, and the LR (its schedule runs in steps) is unchanged:
the update is the mean gradient of a smaller batch, as torchft's averaging over the quorum
makes it. A missing group's slices are skipped, never trained later.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pretrain.config.schema import Config, ConfigError
from pretrain.data.prefetch import Prefetcher
from pretrain.parallel.replica_groups import ReplicaGroups, load_local_state, local_state
from pretrain.train import trainer as loop

log = logging.getLogger("pretrain")

GROUP_ENV = "PRETRAIN_FT_GROUP"  # this process's replica group, 0..ft.groups-1


class NotCommitted(RuntimeError):
    """A peer failed during the step: its gradients were not averaged; take it again."""


class AveragedStep:
    """The step strategy, with the gradients averaged over the replica groups (and the
    commit voted) between its backward and the clip; everything else is the strategy's."""

    def __init__(self, inner, groups: ReplicaGroups, params):
        self.__dict__.update(_inner=inner, _groups=groups, _params=params)

    def forward_backward(self, x, y, measure):
        loss, small = self._inner.forward_backward(x, y, measure)
        if not self._groups.average(self._params()):
            raise NotCommitted
        return loss, small

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


def ft_problems(cfg: Config, group: int | None) -> list[str]:
    ft = cfg.ft
    out = []
    if ft.mode not in ("none", "torchft"):
        out.append(f"ft.mode={ft.mode}: 'none' or 'torchft'")
    if ft.mode == "torchft":
        if group is None or not 0 <= group < ft.groups:
            out.append(f"{GROUP_ENV} must name this replica group, 0..{ft.groups - 1} "
                       f"(ft.groups={ft.groups}); slurm/ft_group.sbatch sets it")
        if not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
            out.append("ft.lighthouse=http://HOST:PORT (or $TORCHFT_LIGHTHOUSE): "
                       "the Lighthouse's address (slurm/ft_lighthouse.sh starts one)")
        if getattr(cfg.batch_ramp.name, "value", cfg.batch_ramp.name) != "none":
            out.append("ft.mode=torchft with a batch ramp: use batch_ramp=none")
        if cfg.optim.spike_guard:  # judged on each group's own loss: groups would diverge
            out.append("ft.mode=torchft with optim.spike_guard=true: use optim.spike_guard="
                       "false (each group would judge its own loss and skip other steps)")
    return out


class ReplicaGroupTrainer(loop.Trainer):
    """The trainer of replica group ``$PRETRAIN_FT_GROUP`` (see the module's docstring)."""

    def __init__(self, cfg: Config, run_dir: Path):
        group = os.environ.get(GROUP_ENV)
        self.group = int(group) if group is not None and group.isdigit() else None
        problems = ft_problems(cfg, self.group)
        if problems:
            raise ConfigError(problems)
        super().__init__(cfg, Path(run_dir) / f"group{self.group}")
        self.groups_n = cfg.ft.groups
        self.replicas: ReplicaGroups | None = None
        self.redone = 0  # steps taken again after a peer failed during them

    def _load_data(self) -> None:
        """The read-ahead strides over every group's slices of a step."""
        super()._load_data()
        self.prefetch.close()
        self.prefetch = Prefetcher(self.train_data, self.layout.local_batch_size,
                                   self.cfg.train.global_batch_size * self.groups_n,
                                   pin=self.device.type == "cuda")

    def _build_training(self) -> None:
        super()._build_training()
        ft = self.cfg.ft
        self.replicas = ReplicaGroups(
            self.group, ft.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"],
            ft.min_replicas, ft.timeout_s, self.heal_state, self.load_heal_state,
            ft.quorum_retries)
        params = lambda: [p for part in self.module.parts for p in part.parameters()]  # noqa
        self.module.strategy = AveragedStep(self.module.strategy, self.replicas, params)

    def _start_run(self) -> None:
        super()._start_run()
        self.replicas.set_step(self.step)  # a resumed group's place, for the quorum

    # -- what a heal sends and loads ------------------------------------------------------

    def heal_state(self) -> dict:
        return {"train": self.state_dict(),
                **local_state(self.module.parts, self.module.optimizer)}

    def load_heal_state(self, state: dict) -> None:
        load_local_state(state, self.module.parts, self.module.optimizer)
        self.load_state_dict(state["train"])
        log.info("torchft: healed from a live peer at step %d", self.step)

    # -- the step -------------------------------------------------------------------------

    def _local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of this group's slice of the step (module docstring)."""
        b = self.cfg.train.global_batch_size
        n = self.layout.local_batch_size
        key = self.step * b * self.groups_n + self.group * b + self.place.dp_rank * n
        x, y = self.prefetch.get(key)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step_local(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            self.replicas.start_step()
            try:
                return super().train_step_local()
            except NotCommitted:
                self.module.optimizer.zero_grad(set_to_none=True)
                self.redone += 1
                log.warning("torchft: step %d not committed (a peer failed during it): "
                            "taking it again (%d redone)", self.step + 1, self.redone)

    def close(self, leave_group: bool = True) -> None:
        super().close(leave_group)
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None


def run(cfg: Config, run_dir: Path) -> dict | None:
    """train.py's entry: the replica group's trainer under ft.mode=torchft,
    the plain one otherwise."""
    if cfg.ft.mode == "torchft" and not cfg.dry_run:
        return loop.run(cfg, run_dir, trainer_class=ReplicaGroupTrainer)
    return loop.run(cfg, run_dir)
