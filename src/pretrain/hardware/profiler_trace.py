"""What a torch.profiler trace says, in one line: the ops that took the time, and the shares
of the profiled steps spent computing, communicating and idle. Read from the Chrome/Perfetto
trace JSON that ``export_chrome_trace`` writes, so the run's log line (the profiler service)
and ``tools/trace_summary.py`` (a folder of traces, every rank) say the same thing.

The window is the union of the ``ProfilerStep#N`` annotations. With device kernels in the
trace (CUDA) the shares are of the device's time: compute is any non-collective kernel
running, communication a collective kernel (``nccl``) running while no compute kernel is
(exposed communication), idle no kernel at all. Without (a CPU run) they are of the training
thread's time: compute is an ``aten::`` op running on it, communication a collective
running (gloo's ``gloo:<op>`` span on its worker thread, which lasts until every peer has
arrived) while no compute is, idle neither (Python, the data loader's hand-off).
Self time is an event's duration less its children's on the same thread (or, for kernels,
its duration).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

COMM = re.compile(r"^(c10d::|gloo:|nccl:)|nccl|record_param_comms|all_?reduce|all_?gather|"
                  r"reduce_?scatter|all_?to_?all|broadcast|sendrecv", re.IGNORECASE)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP = re.compile(r"^ProfilerStep#(\d+)$")


def is_comm(name: str) -> bool:
    return bool(COMM.search(name))


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) not covered by union(b)."""
    return union_length(a + b) - union_length(b)


@dataclass
class TraceSummary:
    """One trace: its rank, steps, window and shares, top ops, and collectives."""

    rank: int | None
    steps: list[int]
    window_us: float
    compute: float
    comm: float
    idle: float
    device: bool  # shares of device time (kernels) rather than the training thread's
    top: list[tuple[str, float]]  # (name, share of the window's self time), largest first
    # collective name -> (count, total microseconds) on this rank
    collectives: dict[str, tuple[int, float]] = field(default_factory=dict)
    ops: set[str] = field(default_factory=set)  # every op name in the window

    @property
    def step_ms(self) -> float:
        return self.window_us / max(len(self.steps), 1) / 1e3

    def line(self, n_top: int = 5) -> str:
        where = "device" if self.device else "training thread"
        steps = (f"steps {self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1
                 else f"step {self.steps[0]}" if self.steps else "no steps")
        top = ", ".join(f"{n} {s:.0%}" for n, s in self.top[:n_top])
        rank = f"rank {self.rank} " if self.rank is not None else ""
        return (f"profile {rank}{steps}: {self.step_ms:.1f} ms a step; {where} compute "
                f"{self.compute:.0%}, communication {self.comm:.0%}, idle {self.idle:.0%}; "
                f"top self time: {top}")


def read_trace(path: Path | str) -> dict:
    return json.loads(Path(path).read_text())


def self_times(events: list[dict]) -> dict[str, float]:
    """Each name's self time (µs) over ``events`` (complete events of one kind), per
    thread: a duration less its direct children's."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, child time]
        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                top = stack.pop()
                out[top[1]] += top[3] - top[2]
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([end, e["name"], 0.0, e["dur"]])
        for top in stack:
            out[top[1]] += top[3] - top[2]
    return out


def collective_events(in_window: list[dict], kernels: list[dict], ops: list[dict],
                      main: set) -> list[dict]:
    """The events that are a collective running, with the time it waited for its peers:
    NCCL kernels on a GPU; on a CPU gloo's own ``gloo:<op>`` spans on its worker threads
    (the training thread's ``c10d::`` op only launches it when the op is async, as FSDP's
    are), or the training thread's ``c10d::`` ops when gloo's spans are missing."""
    if kernels:
        return [e for e in kernels if is_comm(e["name"])]
    gloo = [e for e in in_window if e.get("name", "").startswith(("gloo:", "mpi:"))]
    return gloo or [e for e in ops if e["name"].startswith("c10d::")
                    and (not main or (e["pid"], e["tid"]) in main)]


def summarize(trace: dict, rank: int | None = None) -> TraceSummary:
    """The one-line summary of a trace (``read_trace``)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if rank is None:
        rank = (trace.get("distributedInfo") or {}).get("rank")
    steps = [e for e in events if STEP.match(e.get("name", ""))]
    if steps:
        lo = min(e["ts"] for e in steps)
        hi = max(e["ts"] + e["dur"] for e in steps)
        main = {(e["pid"], e["tid"]) for e in steps}
    else:
        lo = min((e["ts"] for e in events), default=0.0)
        hi = max((e["ts"] + e["dur"] for e in events), default=0.0)
        main = set()
    window = max(hi - lo, 1e-9)

    def inside(e: dict) -> tuple[float, float]:
        return max(e["ts"], lo), min(e["ts"] + e["dur"], hi)

    in_window = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    kernels = [e for e in in_window if e.get("cat") in DEVICE_CATS]
    ops = [e for e in in_window if e.get("cat") == "cpu_op"]
    device = bool(kernels)
    coll = collective_events(in_window, kernels, ops, main)
    if device:
        compute_iv = [inside(e) for e in kernels if not is_comm(e["name"])]
        top_times = defaultdict(float)
        for e in kernels:
            top_times[e["name"]] += e["dur"]
    else:  # the training thread's aten ops compute; waiting inside wrappers does not
        compute_iv = [inside(e) for e in ops if e["name"].startswith("aten::")
                      and (not main or (e["pid"], e["tid"]) in main)]
        top_times = self_times(ops)
    compute = union_length(compute_iv)
    comm = _subtract([inside(e) for e in coll], compute_iv)
    total = sum(top_times.values()) or 1.0
    top = sorted(((n, t / total) for n, t in top_times.items()), key=lambda x: -x[1])
    collectives: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in coll:
        collectives[e["name"]][0] += 1
        collectives[e["name"]][1] += e["dur"]
    return TraceSummary(
        rank=rank, steps=sorted(int(STEP.match(e["name"]).group(1)) for e in steps),
        window_us=window, compute=compute / window, comm=comm / window,
        idle=max(0.0, 1 - (compute + comm) / window), device=device, top=top,
        collectives={k: (c, t) for k, (c, t) in collectives.items()},
        ops={e["name"] for e in in_window})


def rank_of(path: Path, trace: dict) -> int | None:
    """A trace's rank: its ``distributedInfo``, else ``rank<N>`` in its file name."""
    info = trace.get("distributedInfo") or {}
    if "rank" in info:
        return int(info["rank"])
    m = re.search(r"rank(\d+)", path.name)
    return int(m.group(1)) if m else None


def summarize_folder(folder: Path) -> list[TraceSummary]:
    """Every ``*.json`` trace under ``folder`` (its subfolders too), by rank then window."""
    out = []
    for path in sorted(Path(folder).rglob("*.json")):
        trace = read_trace(path)
        if "traceEvents" in trace:
            out.append(summarize(trace, rank_of(path, trace)))
    return sorted(out, key=lambda s: (s.rank if s.rank is not None else -1,
                                      s.steps[:1] or [0]))


def collective_table(summaries: list[TraceSummary]) -> list[str]:
    """One line per collective over the ranks' traces: its calls and time per rank, and
    the slowest rank, the one the others waited for (the least time inside it: it arrived
    last), with the most waiting one."""
    per: dict[str, dict[int, tuple[int, float]]] = defaultdict(dict)
    for s in summaries:
        for name, (count, us) in s.collectives.items():
            c0, t0 = per[name].get(s.rank if s.rank is not None else -1, (0, 0.0))
            per[name][s.rank if s.rank is not None else -1] = (c0 + count, t0 + us)
    lines = []
    for name, ranks in sorted(per.items(), key=lambda kv: -max(t for _, t in kv[1].values())):
        times = {r: t for r, (_, t) in ranks.items()}
        slow, waits = min(times, key=times.get), max(times, key=times.get)
        each = ", ".join(f"r{r} {t / 1e3:.1f} ms" for r, t in sorted(times.items()))
        calls = max(c for c, _ in ranks.values())
        lines.append(f"{name}: {calls} calls; {each}; slowest rank {slow} (the others waited "
                     f"up to {(times[waits] - times[slow]) / 1e3:.1f} ms for it, rank "
                     f"{waits} the longest)" if len(times) > 1 else
                     f"{name}: {calls} calls; {each}")
    return lines
