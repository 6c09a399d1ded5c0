"""Effective training time under a schedule of node faults, restart path vs torchft path
(issue 71; docs/reliability.md#torchft has the figures and the commands that made them).

    SLURM_LOCAL_DIR=/tmp/pretrain-slurm-nodes SLURM_LOCAL_PORT=7817 SLURM_LOCAL_DB_PORT=3407 \\
        slurm/local_cluster.sh start --nodes 4 --netns
    M="python tools/measure_fault_schedule.py --work W --data NAME"   # same SLURM_LOCAL_DIR
    $M --path restart --no-faults --minutes 2 --out restart-nofault.json
    for k in 4 3 2 1; do $M --path torchft --no-faults --live $k --minutes 2 \\
        --out torchft-nofault-$k.json; done
    $M --path torchft --kill-order n2,n3,n4,n1 --out torchft-full.json \\
        --baseline torchft-nofault-*.json        # 15 min, a kill every 120 s from 60 s
    $M --path restart --kill-order n2,n3,n4,n1 --out restart-full.json \\
        --baseline restart-nofault.json

Trains for ``--minutes`` of wall time from the first step, on ``--nodes`` nodes one rank
each: ``restart``, one job of a fixed dp = nodes (tools/launch.py, slurm/train.sbatch, DDP by
default: a lost node ends the attempt, the job requeues and resumes from the newest
checkpoint on nodes that are up); ``torchft``, one replica group a node (slurm/ft_group.sbatch,
pinned to it) and a Lighthouse here, off every node. The nodes of ``--kill-order`` are killed
in turn (``kill-node``: slurmd and ranks, SIGKILL) every ``--kill-every`` seconds from
``--first-kill``, each revived ``--revive-after`` seconds later. The same global batch either
way (torchft: global / nodes a group). ``--live K`` (with ``--no-faults``) starts only K
groups: the no-fault step time of K live groups, which prices the steps a faulty run took with
K groups (``effective``'s docstring says why). Prints one JSON line; ``--out`` also keeps, per
step, the groups that took part, their mean loss and when it was logged. Needs the corpus
prepared under W/data (tools/measure_node_loss.py says how).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "slurm" / "local_cluster.sh"


def sh(*cmd: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), env=env, capture_output=True, text=True, **kw)


def losses(text: str) -> list[tuple[int, float]]:
    """(step, loss) of every training line in ``text``, attempts after each other."""
    out = []
    for line in text.splitlines():
        if '"loss"' in line and line.endswith("}"):
            m = json.loads(line)
            out.append((m["step"], m["loss"]))
    return out


class Clock:
    """When each training line appeared (polled: the metrics hold no wall time). Each poll
    reads only what the files gained since the last (they are only appended to): rereading
    them whole every 0.3 s took CPU from the groups it timed, more as the files grew."""

    def __init__(self, paths: list[Path]):
        self.paths, self.seen = paths, [[] for _ in paths]  # per path: (step, loss, time)
        self.read = [0] * len(paths)  # bytes of whole lines read, per path

    def poll(self) -> None:
        now = time.time()
        for i, (path, seen) in enumerate(zip(self.paths, self.seen, strict=True)):
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(self.read[i])
                new = f.read()
            whole = new[:new.rfind(b"\n") + 1]  # a line being written waits for the next
            self.read[i] += len(whole)
            seen.extend((s, v, now) for s, v in losses(whole.decode()))


def common(work: Path, runs: Path, name: str, model: list[str], batch: int,
           data: str) -> list[str]:
    return ["+recipe=tiny-zero3", "precision=fp32", "model.vocab_size=300",
            "data.source=text", f"data.name={data}",
            "data.data_files=[" + ",".join(f"corpus/doc{i:02d}.txt" for i in range(10)) + "]",
            "data.tokenizer_vocab_size=300", "data.validation_fraction=0.1",
            "data.num_proc=1", f"data.root={work / 'data'}", f"runs_dir={runs}",
            f"run_name={name}", "budget=steps", "budget.steps=5000", "data.max_epochs=1000",
            f"train.global_batch_size={batch}", "parallel.micro_batch_size=2",
            "train.eval_batches=2", "train.eval_interval=5000", "train.sample_tokens=0",
            "train.noise_scale=false",
            "logging=quiet", "logging.log_interval=1", "checkpoint.enabled=true",
            "checkpoint.interval_steps=20", "checkpoint.async_save=false", *model]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rate(seen: list[tuple[int, float, float]]) -> float | None:
    """Seconds a step after the first 10 (start-up, first checkpoint) of one group."""
    if len(seen) < 21:
        return None
    (s0, _, t0), (s1, _, t1) = seen[10], seen[-1]
    return (t1 - t0) / (s1 - s0)


def summary(args, per: list[list[tuple[int, float, float]]], t0: float, wall: float,
            done: list, redone: int) -> dict:
    """The run's figures: per step, the groups that took part (torchft; the restart path's
    steps are all whole) and their mean loss; steps kept, trained again, group-steps missed."""
    groups: dict[int, list[float]] = {}
    when: dict[int, float] = {}
    for seen in per:
        for s, v, t in {s: (s, v, t) for s, v, t in seen}.values():  # an attempt's rerun wins
            groups.setdefault(s, []).append(v)
            when[s] = min(when.get(s, t), t)
    live = len(per) if args.path == "torchft" else 1
    steps = sorted(groups)
    logged = sum(len(seen) for seen in per)
    return {
        "path": args.path, "faults": not args.no_faults, "groups_started": live,
        "nodes": args.nodes, "kills": done, "wall_s": round(wall, 1),
        "model": args.model, "batch": args.batch,
        "steps_kept": len(steps), "last_step": max(steps, default=0),
        "steps_after_t0": sum(1 for s in steps if when[s] >= t0),
        "steps_redone": redone if args.path == "torchft" else logged - len(steps),
        "group_steps_missed": sum(live - len(groups[s]) for s in steps),
        "step_s": min((r for r in map(rate, per) if r), default=None),
        "per_step": {str(s): [len(groups[s]), round(sum(groups[s]) / len(groups[s]), 5),
                         round(when[s] - t0, 2)] for s in steps},
    }


def effective(run: dict, baselines: list[dict]) -> dict:
    """Effective training time as issue 71 defines it: the uninterrupted run's time for the
    steps that counted over the wall time, each step priced at the no-fault step time of a run
    with as many live groups as that step had (on this machine the groups share 2 cores, so a
    step of 3 groups is faster than one of 4: pricing it at 4 groups' time would credit the
    faulty run with the CPU its dead group freed)."""
    base = {b["groups_started"]: b for b in baselines if b["path"] == run["path"]}
    after = [v for v in run["per_step"].values() if v[2] >= 0]
    need = sorted({v[0] for v in after})
    if any(k not in base or not base[k]["step_s"] for k in need):
        return {"effective": None, "missing_baselines": [k for k in need if k not in base]}
    counted = sum(base[v[0]]["step_s"] for v in after)
    out = {"effective": round(counted / run["wall_s"], 4),
           "baseline_step_s": {k: round(base[k]["step_s"], 4) for k in need}}
    ref = base.get(max(base))  # the uninterrupted run with every group: the loss reference
    common = sorted(set(map(int, run["per_step"])) & set(map(int, ref["per_step"])))[-50:]
    if common:
        mean = lambda r: sum(r["per_step"][str(s)][1] for s in common) / len(common)  # noqa
        out["loss_vs_reference"] = {"steps": [common[0], common[-1]], "run": round(mean(run), 4),
                                    "reference": round(mean(ref), 4)}
    return out


def effective_in_run(run: dict, revive_after: float = 30.0, rejoined: float = 60.0,
                     settle: float = 3.0) -> dict:
    """Effective time with each step priced by the faulty run itself, not by separate no-fault
    runs (whose step times moved by up to 7% between runs here: 103.9% against them). A step
    of the run's full group count is priced at the mean of its own steady steps with every
    group in and nothing starting (before the first kill, or ``rejoined`` s after the last); a
    step of fewer groups at the mean of its steady steps ``settle``-``revive_after`` s after a
    kill (the dead group gone, its node not yet back, nothing starting). Steady: the steps
    before and after had as many groups (not a kill's spoiled step). A group count with no
    such step (a kill's one 2-group step) is priced by the no-fault baselines
    (``baseline_step_s``), or not at all."""
    kills = sorted(k[0] for k in run["kills"])
    ps = sorted((int(s), v) for s, v in run["per_step"].items())
    ps = [v for _, v in ps if v[2] >= 0]
    full = run["groups_started"]
    quiet: dict[int, list[float]] = {}
    for i in range(1, len(ps) - 1):
        (g0, _, t0), (groups, _, t), (g2, _, _) = ps[i - 1], ps[i], ps[i + 1]
        since = t - max((k for k in kills if k <= t), default=-math.inf)
        if g0 == groups == g2 and (
                (groups == full and i > 10 and since > rejoined)
                or (groups < full and settle < since < revive_after)):
            quiet.setdefault(groups, []).append(t - t0)
    price = {g: sum(v) / len(v) for g, v in quiet.items()}
    fallback = {int(g): p for g, p in run.get("baseline_step_s", {}).items()}
    steps = [v[0] for v in ps[1:]]
    unpriced = sorted({g for g in steps if g not in price and g not in fallback})
    if unpriced:
        return {"effective_in_run": None, "unpriced_groups": unpriced}
    counted = sum(price.get(g, fallback.get(g, 0.0)) for g in steps)
    return {"effective_in_run": round(counted / run["wall_s"], 4),
            "in_run_step_s": {g: round(p, 4) for g, p in sorted(price.items())},
            "in_run_quiet_steps": {g: len(v) for g, v in sorted(quiet.items())},
            "priced_by_baseline": sorted({g for g in steps if g not in price})}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, help="holds corpus/ and data/ (required to run)")
    ap.add_argument("--path", choices=["restart", "torchft"])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=15)
    ap.add_argument("--kill-every", type=float, default=120)
    ap.add_argument("--first-kill", type=float, default=60)
    ap.add_argument("--revive-after", type=float, default=30)
    ap.add_argument("--kill-order", default="", help="nodes, comma-separated (n1,...,nN)")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--live", type=int, default=0,
                    help="torchft, --no-faults: start only this many groups (a baseline)")
    ap.add_argument("--batch", type=int, default=16, help="global sequences a step")
    ap.add_argument("--data", default="tinytext", help="data.name prepared under W/data")
    ap.add_argument("--dp-mode", default="ddp", help="the restart path's parallel.dp_mode")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000,
                    help="the Lighthouse's (slurm/ft_lighthouse.sh's default)")
    ap.add_argument("--join-timeout-ms", type=int, default=2000)
    ap.add_argument("--out", type=Path, help="write the whole summary (per step) here")
    ap.add_argument("--baseline", type=Path, nargs="*", default=[],
                    help="--out files of no-fault runs: effective time, loss reference")
    ap.add_argument("--reprice", type=Path,
                    help="only price a saved --out file by its own quiet steps, and print it")
    ap.add_argument("--model", nargs="*", default=["model=nano", "model.n_layer=8",
                                                   "model.d_model=256", "model.n_head=4",
                                                   "model.seq_len=128"])
    args = ap.parse_args()
    if args.reprice:
        run = json.loads(args.reprice.read_text())
        print(json.dumps(effective_in_run(run, args.revive_after)))
        return 0
    if args.work is None or args.path is None:
        ap.error("--work and --path are required (or --reprice RUN.json)")
    env = {**os.environ, "PATH": os.environ["PATH"] + ":/usr/sbin:/sbin"}
    env["SLURM_CONF"] = sh("bash", str(CLUSTER), "env", env=env,
                           check=True).stdout.split("=", 1)[1].strip()
    live = args.live or args.nodes
    name = f"{args.path}-{'nofault' if args.no_faults else 'faults'}" + (
        f"-live{live}" if live != args.nodes else "")
    runs = args.work / "runs"
    shutil.rmtree(runs / name, ignore_errors=True)
    (runs / name).mkdir(parents=True)
    nodes = [f"n{i + 1}" for i in range(args.nodes)]
    order = args.kill_order.split(",") if args.kill_order else nodes
    netns = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/pretrain-slurm"), "netns")
    iface = "eth0" if netns.exists() and netns.read_text().strip() == "1" else "lo"
    base = common(args.work, runs, name, args.model, args.batch, args.data)
    lighthouse, jobs = None, []
    if args.path == "restart":
        out = sh(sys.executable, str(REPO / "tools" / "launch.py"), *base, "cluster=local",
                 "cluster.procs_per_node=1", f"parallel.dp={args.nodes}",
                 f"parallel.dp_mode={args.dp_mode}", f"cluster.env.GLOO_SOCKET_IFNAME={iface}",
                 f"--nodes={args.nodes}", env=env, cwd=args.work, check=True).stdout
        jobs.append(re.search(r"submitted job (\d+)", out).group(1))
        metrics = [runs / name / "metrics.jsonl"]
    else:
        port = free_port()
        lighthouse = subprocess.Popen(  # here, on the host: off every node the schedule kills
            ["torchft_lighthouse", "--bind", f"[::]:{port}", "--min_replicas", "1",
             "--join_timeout_ms", str(args.join_timeout_ms),
             "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        address = f"http://{socket.gethostname()}:{port}"
        per_group = args.batch // args.nodes
        for g, node in enumerate(nodes[:live]):
            ft = [f"train.global_batch_size={per_group}", "parallel=single",
                  "ft.mode=torchft", f"ft.groups={args.nodes}",
                  f"ft.lighthouse={address}"]
            out = sh("sbatch", "--parsable", f"--nodelist={node}",
                     f"--output={runs / name}/slurm-%j.out",
                     str(REPO / "slurm" / "ft_group.sbatch"), *base, *ft,
                     env={**env, "PRETRAIN_FT_GROUP": str(g), "TORCHFT_LIGHTHOUSE": address,
                          "PYTHON": sys.executable, "TRAIN_PY": str(REPO / "train.py")},
                     cwd=args.work, check=True).stdout
            jobs.append(out.strip().split(";")[0])
        metrics = [runs / name / f"group{g}" / "metrics.jsonl" for g in range(live)]
    clock = Clock(metrics)
    while not any(clock.seen):
        clock.poll()
        time.sleep(0.2)
    t0 = time.time()
    end = t0 + args.minutes * 60
    count = 0 if args.no_faults else int((args.minutes * 60 - args.first_kill - 1e-9)
                                         // args.kill_every) + 1
    kills = [(t0 + args.first_kill + i * args.kill_every, order[i % len(order)])
             for i in range(max(count, 0))]
    revives, done = [], []
    while time.time() < end:
        now = time.time()
        if kills and now >= kills[0][0]:
            _, node = kills.pop(0)
            sh("bash", str(CLUSTER), "kill-node", node, env=env)
            done.append((round(now - t0, 1), node))
            revives.append((now + args.revive_after, node))
        if revives and now >= revives[0][0]:
            sh("bash", str(CLUSTER), "revive-node", revives.pop(0)[1], env=env, timeout=120)
        clock.poll()
        time.sleep(0.3)
    wall = time.time() - t0
    clock.poll()
    for job in jobs:
        sh("scancel", job, env=env)
    for _, node in revives:
        sh("bash", str(CLUSTER), "revive-node", node, env=env, timeout=120)
    if lighthouse is not None:
        lighthouse.kill()
    redone = sum(p.read_text().count("not committed") for p in (runs / name).glob("slurm-*.out"))
    result = summary(args, clock.seen, t0, wall, done, redone)
    if args.baseline:
        result.update(effective(result, [json.loads(p.read_text()) for p in args.baseline]))
    if not args.no_faults:
        result.update(effective_in_run(result, args.revive_after))
    if args.out:
        args.out.write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_step", "model")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
