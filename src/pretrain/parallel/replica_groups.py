"""Replica groups that come and go: torchft's per-step fault tolerance across nodes.

Each node is one replica group (its ranks shard the model among themselves, as any layout of
this package does); the groups replicate each other and meet once a step through torchft
(PyPI ``torchft``, the ``[ft]`` extra): a ``Manager`` per group asks the job's Lighthouse for
the step's quorum (the groups alive), averages the gradients over that quorum on torchft's
reconfigurable gloo group, and votes on the commit. A group that died is simply absent from
the next quorum; one that comes back is sent a live peer's state (the manager's
``state_dict`` transfer, over HTTP) before its first step. The way torchft's own train_ddp.py
and torchtitan's ``components/ft`` use it, with the quorum taken synchronously
(``use_async_quorum=False``) so a heal is applied before the step's forward, never inside it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("pretrain")
NICE_ENV = "PRETRAIN_FT_NICE_FROM"  # the priority a niced start-up returns to (ft_group.sbatch)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a DTensor's local tensor), or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicaGroups:
    """This rank's torchft Manager: ``start_step`` before a step (may heal this group),
    ``average`` after its backward (returns the commit vote). ``group`` numbers this replica
    group (its replica id ``group<N>``); its ranks are the process group's, if one exists."""

    def __init__(self, group: int, lighthouse: str, min_replicas: int, timeout_s: float,
                 state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None],
                 quorum_retries: int = 0):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers: every step otherwise
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)

        host = socket.gethostname()  # what the other groups reach this node by
        rank, world = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized()
                       else (0, 1))
        self.store = None
        port = [0]
        if rank == 0:  # the group's own store: the other groups' gloo meets in the primary's
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = [self.store.port]
        if world > 1:
            dist.broadcast_object_list(port, src=0)
        timeout = timedelta(seconds=timeout_s)
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg, min_replica_size=min_replicas,
            load_state_dict=load_state_dict, state_dict=state_dict, use_async_quorum=False,
            replica_id=f"group{group}", lighthouse_addr=lighthouse, hostname=host,
            store_addr=host, store_port=port[0], rank=rank, world_size=world,
            timeout=timeout, quorum_timeout=timedelta(seconds=max(60.0, 4 * timeout_s)),
            connect_timeout=timeout, quorum_retries=quorum_retries)
        self.participants = 0  # the last quorum's size, for the log
        self.spent = {"quorum": 0.0, "all-reduce": 0.0, "commit vote": 0.0}  # s, for the log
        self.steps = 0

    def _timed(self, part: str, start: float) -> None:
        self.spent[part] += time.perf_counter() - start

    def start_step(self) -> None:
        """The step's quorum (blocks until the Lighthouse gives one); a group behind the
        others (joining, or back from a failure) loads a live peer's state here. Every 50
        steps the log says what torchft's own parts took a step on average."""
        if self.steps and self.steps % 50 == 0:
            log.info("torchft: mean per step over %d steps: %s", self.steps, ", ".join(
                f"{k} {1000 * v / self.steps:.1f} ms" for k, v in self.spent.items()))
        if not self.steps:
            startup_priority_restored()  # a joining group: at full speed from its heal on
        self.steps += 1
        start = time.perf_counter()
        self.manager.start_quorum()
        self._timed("quorum", start)
        n = self.manager.num_participants()
        if n != self.participants:
            log.info("torchft: %d replica group(s) in this step's quorum (was %d), step %d",
                     n, self.participants, self.manager.current_step())
            self.participants = n

    def average(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """The gradients averaged over the quorum's groups (one flat all-reduce a rank),
        then the commit vote: False when a peer failed during the step (the gradients are
        then garbage and the step is to be taken again).

        When this rank's all-reduce failed, its process group is closed at once, not at the
        next quorum's reconfiguration as torchft would: a live peer that waits on this rank
        rather than on the dead one (a ring's far side) sees its connection close and fails
        now. Otherwise it failed only once the groups that saw the death first had their
        next quorum (without it, after the Lighthouse's join timeout) and reconfigured, then
        joined late and healed: a step of fewer groups and a heal at every lost group."""
        start = time.perf_counter()
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()
            if self.manager.errored() is not None:
                self.pg.abort()  # the next quorum (a new quorum id) configures a new one
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._timed("all-reduce", start)
        start = time.perf_counter()
        vote = self.manager.should_commit()
        self._timed("commit vote", start)
        return vote

    def set_step(self, step: int) -> None:
        """After a resume from a checkpoint: the manager's step is the run's."""
        self.manager.load_state_dict({"step": step,
                                      "batches_committed": self.manager.batches_committed()})

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def startup_priority_restored() -> None:
    """Every thread of this process back to the scheduling priority ``$PRETRAIN_FT_NICE_FROM``
    names, if set: slurm/ft_group.sbatch starts a requeued group's process under ``nice``
    (its imports, model build, checkpoint load) so that, where nodes share CPUs, a group
    coming back does not slow the groups training; it asks to join at full priority, as
    its heal and its steps hold the others up. Linux keeps a nice value per thread (the
    ones started so far inherited it), hence every task of the process."""
    target = os.environ.pop(NICE_ENV, None)
    if target is None:
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), int(target))
    except (OSError, ValueError) as e:
        log.warning("torchft: the start-up priority could not be restored (%s): "
                    "this group trains at nice %d", e, os.getpriority(os.PRIO_PROCESS, 0))
        return
    log.info("torchft: start-up done under nice, back to priority %s to join", target)


def local_state(module_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict:
    """This rank's model and optimizer state as plain local tensors (what a heal sends:
    the receiving rank holds the same shards of the same layout)."""
    def tree(x):
        if isinstance(x, torch.Tensor):
            return local_tensor(x).detach()
        if isinstance(x, dict):
            return {k: tree(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(tree(v) for v in x)
        return x

    model = {f"{i}.{k}": local_tensor(v).detach()
             for i, part in enumerate(module_parts) for k, v in part.state_dict().items()}
    return {"model": model, "optim": tree(optimizer.state_dict())}


def load_local_state(state: dict, module_parts: list[torch.nn.Module],
                     optimizer: torch.optim.Optimizer) -> None:
    """``local_state``'s counterpart: copy into this rank's shards; the optimizer's state
    tensors put back on their parameters' meshes."""
    with torch.no_grad():
        for i, part in enumerate(module_parts):
            for k, v in part.state_dict().items():
                local_tensor(v).copy_(state["model"][f"{i}.{k}"])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = state["optim"]
    for idx, per in saved["state"].items():
        p = params[int(idx)]
        for name, value in per.items():
            if isinstance(value, torch.Tensor) and hasattr(p, "to_local") and value.dim():
                from torch.distributed.tensor import DTensor

                per[name] = DTensor.from_local(value, p.device_mesh, p.placements,
                                               run_check=False)
    optimizer.load_state_dict(saved)
