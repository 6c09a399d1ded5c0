"""Measure a lost node on the local multi-node Slurm (docs/reliability.md, "A lost node").

    SLURM_LOCAL_DIR=/tmp/pretrain-slurm-nodes SLURM_LOCAL_PORT=7817 SLURM_LOCAL_DB_PORT=3407 \\
        slurm/local_cluster.sh start --nodes 2
    SLURM_LOCAL_DIR=/tmp/pretrain-slurm-nodes python tools/measure_node_loss.py --work /tmp/m \\
        [--fixed-dp]

Submits a 2-node run of the nano model (one rank a node, ZeRO-3, dp from the nodes) through
tools/launch.py, kills its second node (slurm/local_cluster.sh kill-node: its slurmd and its ranks,
SIGKILL) halfway between two checkpoints, and prints, from the job's log: seconds from the
kill to the restart decision and to the first step trained again, and the steps redone.
``--fixed-dp``: the layout fixes dp=2, so the job cannot go on with one node: it requeues
itself (a new checkpoint since it started) and Slurm runs it again on two nodes that are up
(a cluster of 3 or more nodes: a spare), timed the same way. Needs the data already prepared under
``--data-root`` (the tests' corpus: run tests/test_slurm_nodes.py once, or prepare any).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "slurm" / "local_cluster.sh"


def stamp(text: str) -> float:
    return datetime.strptime(text.replace(",", "."), "%Y-%m-%d %H:%M:%S.%f"
                             if "." in text or "," in text else "%Y-%m-%d %H:%M:%S").timestamp()


def metrics_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line).get("step", 0) for line in path.read_text().splitlines()
            if '"loss"' in line]


def state(job: str, env: dict) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True,
                         text=True).stdout
    match = re.search(r"JobState=(\S+)", out)
    return match.group(1) if match else "?"


def submit(args: list[str], env: dict, cwd: Path) -> str:
    out = subprocess.run([sys.executable, str(REPO / "tools" / "launch.py"), *args], env=env,
                         cwd=cwd, capture_output=True, text=True, check=True).stdout
    return re.search(r"submitted job (\d+)", out).group(1)


def wait(job: str, env: dict) -> None:
    while state(job, env) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "?"):
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True, help="holds corpus/ and data/")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--fixed-dp", action="store_true")
    args = ap.parse_args()
    env = {**os.environ, "PATH": os.environ["PATH"] + ":/usr/sbin:/sbin"}
    shown = subprocess.run(["bash", str(CLUSTER), "env"], env=env, check=True,
                           capture_output=True, text=True).stdout
    env["SLURM_CONF"] = shown.split("=", 1)[1].strip()
    name = "fixed-dp" if args.fixed_dp else "elastic"
    runs = args.work / "runs"
    common = ["+recipe=tiny-zero3", "cluster=local", "model=nano", "precision=fp32",
              "cluster.procs_per_node=1", "model.vocab_size=300", "data.source=text",
              "data.name=tinytext",
              "data.data_files=[" + ",".join(f"corpus/doc{i:02d}.txt" for i in range(10)) + "]",
              "data.tokenizer_vocab_size=300", "data.validation_fraction=0.1", "data.num_proc=1",
              f"data.root={args.work / 'data'}", f"runs_dir={runs}", f"run_name={name}",
              "budget=steps", f"budget.steps={args.steps}", "train.global_batch_size=8",
              "parallel.micro_batch_size=2", "train.eval_batches=2",
              f"train.eval_interval={args.steps}", "train.sample_tokens=0", "logging=quiet",
              "logging.log_interval=1", "checkpoint.enabled=true",
              f"checkpoint.interval_steps={args.interval}", "checkpoint.async_save=false"]
    dp = ["parallel.dp=2"] if args.fixed_dp else ["parallel.dp=null"]
    shutil.rmtree(runs / name, ignore_errors=True)  # a fresh run, not a resumed one
    job = submit([*common, *dp, "--nodes=2"], env, args.work)
    run = runs / name
    target = args.interval + args.interval // 2  # halfway to the second checkpoint
    while max(metrics_steps(run), default=0) < target:
        time.sleep(0.05)
    nodelist = re.search(r" NodeList=(\S+)", subprocess.run(
        ["scontrol", "show", "job", "-o", job], env=env, capture_output=True,
        text=True).stdout).group(1)
    victim = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env,
                            capture_output=True, text=True).stdout.split()[-1]
    killed = subprocess.run(["bash", str(CLUSTER), "kill-node", victim], env=env,
                            capture_output=True, text=True, check=True).stderr
    t_kill = stamp(re.search(r"at (\S+ \S+):", killed).group(1))
    last = max(metrics_steps(run))
    wait(job, env)
    log = (run / f"slurm-{job}.out").read_text()
    log = log.split("(restart 1)", 1)[1] if args.fixed_dp else \
        log.split(f"lost node(s) {victim}", 1)[1]
    subprocess.run(["bash", str(CLUSTER), "revive-node", victim], env=env, capture_output=True)
    resumed = int(re.search(r"resumed from \S+step_(\d+)", log).group(1))
    first = re.search(r"\[(\S+ \S+)\]\[pretrain\]\[INFO\] - step \d+/", log)
    t_train = stamp(first.group(1))
    print(f"{name}: killed {victim} at step {last}; resumed from step {resumed}: "
          f"{last - resumed} step(s) redone; training again {t_train - t_kill:.1f} s after "
          "the kill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
