"""A rank that stops arriving: collective timeouts, and the one line that names it.

Start-up (process group, mesh, materialisation, the first evaluation and step) runs under
``comm.init_timeout_s``; once every rank has finished the first step, the world and the
mesh's groups get ``comm.train_timeout_s`` (torchtitan's ``comm.train_timeout_seconds``,
through torch's own ``_set_pg_timeout``, after a barrier so that no rank runs a collective
with the short timeout while another is still starting up). A collective that waits longer
raises on the ranks that arrived (gloo: "Timed out waiting ..."; NCCL's watchdog aborts
after the same timeout and dumps its flight recorder where ``TORCH_NCCL_TRACE_BUFFER_SIZE``
and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` are set).

Which ranks did not arrive: each rank that saw a collective fail says so in the launcher's
key-value store (the TCPStore every rank already shares) and waits a few seconds for the
others; the ranks that never said so are the ones still stuck (or gone). The lowest rank
that saw the failure prints one line naming the collective, the step and those ranks, and
every failed rank exits ``EXIT_HANG`` (76), at once (``os._exit``: a process group with a
dead peer cannot be torn down cleanly, and nothing can be saved without collectives).
slurm/train.sbatch requeues only a run that stopped to be continued (75), so a hang is not
requeued in a loop.

Which node: at start every rank shares the name of the node it runs on (Slurm's
``SLURMD_NODENAME``, else the host name), so the line names the missing ranks' nodes too, and
where ``PRETRAIN_LOST_NODES_FILE`` is set (slurm/train.sbatch sets it) the reporting rank
writes those nodes there, one a line: the script restarts the run on the nodes left.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from pretrain import torch_compat
from pretrain.errors import AGENT_REPORTS

log = logging.getLogger("pretrain")

EXIT_HANG = 76  # sysexits' EX_PROTOCOL: a peer stopped answering
# torch.distributed's collectives, as their functions are named: the innermost one in a
# failed step's traceback is the collective that timed out.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "barrier", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "gather", "scatter", "reduce", "monitored_barrier",
               "wait", "wait_tensor")
KEY = "pretrain/collective_failed"
LOST_NODES_FILE = "PRETRAIN_LOST_NODES_FILE"


def node_name() -> str:
    """This process's node: Slurm's name for it (several nodes may share a host), else the
    host's short name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def where(missing: list[int], nodes: list[str]) -> str:
    """`` (node n2: rank 1; node n3: ranks 2, 3)``: the missing ranks by node, where the
    nodes are known and more than one."""
    if not missing or len(set(nodes)) < 2 or max(missing) >= len(nodes):
        return ""
    by_node: dict[str, list[int]] = {}
    for r in missing:
        by_node.setdefault(nodes[r], []).append(r)
    return " (" + "; ".join(
        f"node {n}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for n, rs in by_node.items()) + ")"


def is_collective_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost a peer (gloo raises RuntimeError, NCCL
    DistBackendError)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("timed out", "timeout", "connection closed by peer",
                            "connection reset by peer", "broken pipe"))


def collective_of(exc: BaseException) -> str:
    """The collective ``exc`` came out of, and the project's frame that called it:
    ``all_reduce (from parallel/grad_clip.py:61)``; the innermost torch.distributed frame
    when no named collective is on the stack."""
    frames = traceback.extract_tb(exc.__traceback__)
    name, caller = None, None
    for frame in frames:
        path = frame.filename.replace(os.sep, "/")
        if "/torch/distributed/" in path and frame.name in COLLECTIVES:
            name = frame.name
        elif "/torch/distributed/" in path and name is None:
            name = f"{frame.name} ({path.rsplit('/torch/', 1)[1]})"
        if "/pretrain/" in path:
            caller = f"{path.rsplit('/pretrain/', 1)[1]}:{frame.lineno}"
    name = name or "a collective"
    return f"{name} (from {caller})" if caller else name


def _record_for_torchrun(line: str) -> None:
    """The line in torchrun's error file too: its failure summary shows it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    entry = {"message": line, "extraInfo": {"py_callstack": line,
                                             "timestamp": str(int(time.time()))}}
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": entry}, f)


def process_groups() -> list:
    """Every process group this process has made so far (the world, each mesh dimension's);
    none where this torch lacks the means."""
    if not (torch_compat.has("set_pg_timeout") and torch_compat.has("c10d_world")):
        return []
    return list(torch_compat.private("c10d_world").pg_map)


def set_timeouts(seconds: float, groups: list) -> bool:
    """``groups`` time their collectives out after ``seconds``; False when there are none
    (this torch lacks the means: they keep the timeout they were made with)."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in groups:
        torch_compat.private("set_pg_timeout")(timeout, group)
    return bool(groups)


class CollectiveWatch:
    """The run's timeouts and, when a collective fails, the one line and the exit."""

    def __init__(self, comm):
        """``comm``: the run's ``comm`` config (init_timeout_s, train_timeout_s)."""
        self.init_timeout_s, self.train_timeout_s = comm.init_timeout_s, comm.train_timeout_s
        self.armed = False
        self.groups: list = []  # the groups the timeouts apply to (start)
        self.nodes: list[str] = []  # each rank's node (start)

    @property
    def active(self) -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def start(self) -> None:
        """After the mesh exists: the world and the mesh's groups (made with torch's default
        timeout, 30 min for gloo, 10 for NCCL) get the start-up one, and they alone will
        get the train timeout: the groups made later (the async checkpoint saves') keep
        torch's default, as a save may write for longer than a step may wait."""
        self.groups = process_groups() if self.active else []
        set_timeouts(self.init_timeout_s, self.groups)
        if self.active:  # each rank's node, known to every rank (the store may be lost too)
            self.nodes = [""] * dist.get_world_size()
            dist.all_gather_object(self.nodes, node_name())

    def after_first_step(self) -> None:
        """Every rank has taken a step: every group of the run gets the train timeout."""
        if self.armed or not self.active:
            return
        self.armed = True
        if self.train_timeout_s == self.init_timeout_s:
            return
        dist.barrier()  # nobody runs a collective on the short timeout before all are here
        if set_timeouts(self.train_timeout_s, self.groups):
                log.info("collective timeout %g s from now on (comm.train_timeout_s; start-up "
                     "had %g s, comm.init_timeout_s)", self.train_timeout_s,
                     self.init_timeout_s)

    @contextlib.contextmanager
    def watching(self, step: Callable[[], int]) -> Iterator[None]:
        """Inside it, a collective's failure is the line and the exit (``fail``) at the step
        ``step()`` names; any other exception passes."""
        try:
            yield
        except Exception as e:
            self.fail(e, step())
            raise

    def fail(self, exc: BaseException, step: int) -> None:
        """A collective failed at ``step``: find who did not arrive, print the line (the
        lowest failed rank), exit EXIT_HANG. Returns (to re-raise) when ``exc`` is not a
        collective's failure or there is no process group."""
        if not self.active or not is_collective_failure(exc):
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        timeout = self.train_timeout_s if self.armed else self.init_timeout_s
        failed = self._failed_ranks(rank, world, grace=max(2.0, min(10.0, timeout / 10)))
        missing = [r for r in range(world) if r not in failed]
        line = (f"error: collective {collective_of(exc)} at step {step} did not complete "
                f"within {timeout:g} s (comm.{'train' if self.armed else 'init'}_timeout_s): "
                f"rank(s) {missing or '?'} did not arrive{where(missing, self.nodes)}"
                f"{'' if missing else ' (every rank saw it fail: a lost connection?)'}; "
                f"exit {EXIT_HANG}. ({' '.join(str(exc).split())[:200]})")
        if rank == min(failed, default=rank):
            _record_for_torchrun(line)
            self._write_lost_nodes(missing)
            if not os.environ.get(AGENT_REPORTS):  # tools/run_local.py prints it itself
                print(line, file=sys.stderr, flush=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        os._exit(EXIT_HANG)

    def _write_lost_nodes(self, missing: list[int]) -> None:
        """The missing ranks' nodes, one a line, where the launcher asked for them (from
        the lowest failed rank, when on the job's first node)."""
        path = os.environ.get(LOST_NODES_FILE)
        # Judged from the job's first node, where the batch script runs (a node cut off from
        # the others would name them instead).
        if (not path or not missing or max(missing) >= len(self.nodes)
                or os.environ.get("SLURM_NODEID", "0") != "0"):
            return
        lost = sorted({self.nodes[r] for r in missing} - {node_name()})
        with contextlib.suppress(OSError):
            Path(path).write_text("".join(f"{n}\n" for n in lost))

    def _failed_ranks(self, rank: int, world: int, grace: float) -> list[int]:
        """The ranks that report a failed collective within ``grace`` seconds (this one
        first); the rest never came back from where they were."""
        try:
            store = torch_compat.private("c10d_default_store")()
            store.set(f"{KEY}/{rank}", "1")
            deadline, seen = time.monotonic() + grace, {rank}
            while time.monotonic() < deadline and len(seen) < world:
                seen |= {r for r in range(world) if store.check([f"{KEY}/{r}"])}
                time.sleep(0.1)
            return sorted(seen)
        except Exception:  # the store is gone too: say what this rank knows
            return [rank]
