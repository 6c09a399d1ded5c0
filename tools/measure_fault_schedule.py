"""Effective training time under a schedule of node faults, restart path vs torchft path
(issue 71; docs/reliability.md#torchft has the figures and the command that made them).

    SLURM_LOCAL_DIR=/tmp/pretrain-slurm-nodes SLURM_LOCAL_PORT=7817 SLURM_LOCAL_DB_PORT=3407 \\
        slurm/local_cluster.sh start --nodes 4
    SLURM_LOCAL_DIR=/tmp/pretrain-slurm-nodes python tools/measure_fault_schedule.py \\
        --work W --path torchft --minutes 4 --kill-every 60 --revive-after 30 [--no-faults]

Trains for ``--minutes`` of wall time from the first step, on ``--nodes`` nodes one rank
each: ``restart``, one job of a fixed dp = nodes (tools/launch.py, slurm/train.sbatch: a lost
node ends the attempt, the job requeues and resumes from the newest checkpoint on nodes that
are up); ``torchft``, one replica group a node (slurm/ft_group.sbatch, pinned to it) and a
Lighthouse here. Node n1 is killed first (``kill-node``: slurmd and ranks, SIGKILL), then
n2, ... every ``--kill-every`` seconds, each revived ``--revive-after`` seconds later. The
same global batch either way (torchft: global / nodes a group). Prints one JSON line: the
steps the run kept, the steps trained and thrown away, each group's steps, the mean step
time, the last losses. Needs the tests' corpus prepared under W/data (tools/measure_node_loss.py
says how).
"""

from __future__ import annotations

import argparse
import json
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


def losses(path: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training line logged, attempts after each other."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if '"loss"' in line and line.endswith("}"):
            m = json.loads(line)
            out.append((m["step"], m["loss"]))
    return out


class Clock:
    """When each training line appeared (polled: the metrics hold no wall time)."""

    def __init__(self, paths: list[Path]):
        self.paths, self.seen = paths, [[] for _ in paths]  # per path: (step, loss, time)

    def poll(self) -> None:
        now = time.time()
        for path, seen in zip(self.paths, self.seen, strict=True):
            lines = losses(path)
            seen.extend((s, v, now) for s, v in lines[len(seen):])


def common(work: Path, runs: Path, name: str, model: list[str], batch: int) -> list[str]:
    return ["+recipe=tiny-zero3", "precision=fp32", "model.vocab_size=300",
            "data.source=text", "data.name=tinytext",
            "data.data_files=[" + ",".join(f"corpus/doc{i:02d}.txt" for i in range(10)) + "]",
            "data.tokenizer_vocab_size=300", "data.validation_fraction=0.1",
            "data.num_proc=1", f"data.root={work / 'data'}", f"runs_dir={runs}",
            f"run_name={name}", "budget=steps", "budget.steps=5000", "data.max_epochs=1000",
            f"train.global_batch_size={batch}", "parallel.micro_batch_size=2",
            "train.eval_batches=2", "train.eval_interval=5000", "train.sample_tokens=0",
            "logging=quiet", "logging.log_interval=1", "checkpoint.enabled=true",
            "checkpoint.interval_steps=20", "checkpoint.async_save=false", *model]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True, help="holds corpus/ and data/")
    ap.add_argument("--path", choices=["restart", "torchft"], required=True)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=4)
    ap.add_argument("--kill-every", type=float, default=60)
    ap.add_argument("--first-kill", type=float, default=30)
    ap.add_argument("--revive-after", type=float, default=30)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--batch", type=int, default=16, help="global sequences a step")
    ap.add_argument("--model", nargs="*", default=["model=nano", "model.n_layer=4",
                                                   "model.d_model=256", "model.n_head=4",
                                                   "model.seq_len=128"])
    args = ap.parse_args()
    env = {**os.environ, "PATH": os.environ["PATH"] + ":/usr/sbin:/sbin"}
    env["SLURM_CONF"] = sh("bash", str(CLUSTER), "env", env=env,
                           check=True).stdout.split("=", 1)[1].strip()
    name = f"{args.path}-{'nofault' if args.no_faults else 'faults'}"
    runs = args.work / "runs"
    shutil.rmtree(runs / name, ignore_errors=True)
    (runs / name).mkdir(parents=True)
    nodes = [f"n{i + 1}" for i in range(args.nodes)]
    netns = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/pretrain-slurm"), "netns")
    iface = "eth0" if netns.exists() and netns.read_text().strip() == "1" else "lo"
    lighthouse, jobs = None, []
    if args.path == "restart":
        out = sh(sys.executable, str(REPO / "tools" / "launch.py"),
                 *common(args.work, runs, name, args.model, args.batch), "cluster=local",
                 "cluster.procs_per_node=1", f"parallel.dp={args.nodes}",
                 f"cluster.env.GLOO_SOCKET_IFNAME={iface}",
                 f"--nodes={args.nodes}", env=env, cwd=args.work, check=True).stdout
        jobs.append(re.search(r"submitted job (\d+)", out).group(1))
        metrics = [runs / name / "metrics.jsonl"]
    else:
        port = free_port()
        lighthouse = subprocess.Popen(
            ["torchft_lighthouse", "--bind", f"[::]:{port}", "--min_replicas", "1",
             "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        address = f"http://{socket.gethostname()}:{port}"
        per_group = args.batch // args.nodes
        for g, node in enumerate(nodes):
            ft = [f"train.global_batch_size={per_group}", "parallel=single",
                  "ft.mode=torchft", f"ft.groups={args.nodes}",
                  f"ft.lighthouse={address}"]
            out = sh("sbatch", "--parsable", f"--nodelist={node}",
                     f"--output={runs / name}/slurm-%j.out",
                     str(REPO / "slurm" / "ft_group.sbatch"),
                     *common(args.work, runs, name, args.model, args.batch), *ft,
                     env={**env, "PRETRAIN_FT_GROUP": str(g), "TORCHFT_LIGHTHOUSE": address,
                          "PYTHON": sys.executable, "TRAIN_PY": str(REPO / "train.py")},
                     cwd=args.work, check=True).stdout
            jobs.append(out.strip().split(";")[0])
        metrics = [runs / name / f"group{g}" / "metrics.jsonl" for g in range(args.nodes)]
    clock = Clock(metrics)
    while not any(clock.seen):
        clock.poll()
        time.sleep(0.2)
    t0 = time.time()
    end = t0 + args.minutes * 60
    kills = [] if args.no_faults else [
        (t0 + args.first_kill + i * args.kill_every, nodes[i % len(nodes)])
        for i in range(int((args.minutes * 60 - args.first_kill) // args.kill_every) + 1)
        if args.first_kill + i * args.kill_every < args.minutes * 60]
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
    for job in jobs:
        sh("scancel", job, env=env)
    for _, node in revives:
        sh("bash", str(CLUSTER), "revive-node", node, env=env, timeout=120)
    if lighthouse is not None:
        lighthouse.kill()
    per = clock.seen
    logged = [[s for s, _, _ in p] for p in per]
    kept = max(max(s, default=0) for s in logged)  # the model's steps at the end
    trained = sum(len(s) for s in logged)  # every step any group/attempt logged
    steady = [p for p in per if len(p) > 20]
    step_s = min((p[-1][2] - p[10][2]) / (len(p) - 11) for p in steady) if steady else None
    last = {s: v for p in per for s, v, _ in p}
    tail = [last[s] for s in sorted(last)[-10:]]
    print(json.dumps({
        "path": args.path, "faults": not args.no_faults, "kills": done, "wall_s": round(wall),
        "steps_kept": kept,
        "steps_logged": trained, "steps_per_group": [len(s) for s in logged],
        "steady_step_s": round(step_s, 4) if step_s else None,
        "loss_last10": round(sum(tail) / len(tail), 4) if tail else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
