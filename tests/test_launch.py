"""tools/launch.py and slurm/train.sbatch without a cluster: allocations derived from
layouts, clear errors on mismatches, the rendered script, and the script's signal and
requeue logic run under bash with stand-ins for srun and scontrol."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, compose_config

sys.path.insert(0, str(REPO / "tools"))

import launch  # noqa: E402


def dry_run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "launch.py"), *args,
                           "--dry-run"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_gpt3_175b_on_1024_gpus_renders_a_valid_script(tmp_path):
    proc = dry_run("+recipe=gpt3-175b", "--partition", "gpu", "--account", "proj",
                   "--time", "48:00:00", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    for line in ("#SBATCH --nodes=128", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --time=48:00:00",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue",
                 f"#SBATCH --output={tmp_path}/runs/gpt3-175b/slurm-%j.out",
                 f"#SBATCH --chdir={tmp_path}",
                 "NPROC_PER_NODE=8", "TRAIN_ARGS=(+recipe=gpt3-175b cluster.partition=gpu "
                 "cluster.account=proj cluster.time=48:00:00)", "export NCCL_DEBUG=WARN"):
        assert line in script.splitlines(), line
    assert "world size 1024 (tp=8, pp=16, dp=8)" in proc.stderr
    # every #SBATCH line precedes the first command, or sbatch ignores it
    lines = script.splitlines()
    first_cmd = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(i < first_cmd for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_allocation_from_layouts():
    big = compose_config(["+recipe=gpt3-175b"])
    assert launch.allocation(big) == launch.Allocation(128, 8, 8)
    assert launch.allocation(big, nodes=64, gpus_per_node=16) == launch.Allocation(64, 16, 16)
    one = compose_config(["+recipe=gpt3-125m"])  # 1 process: a job smaller than a node
    assert launch.allocation(one) == launch.Allocation(1, 1, 1)
    ladder = compose_config(["+recipe=ladder-chinchilla"])  # dp=null: the allocation decides
    alloc = launch.allocation(ladder, nodes=4)
    assert alloc == launch.Allocation(4, 8, 8) and alloc.world_size == 32
    cpu = compose_config(["+recipe=tiny-zero3", "cluster=local"])
    assert launch.allocation(cpu) == launch.Allocation(1, 2, 0)


@pytest.mark.parametrize("args, message", [
    (("--gpus-per-node", "4"), "4 GPUs per node is not a multiple of parallel.tp=8"),
    (("--gpus-per-node", "12"), "12 GPUs per node is not a multiple of parallel.tp=8"),
    (("--nodes", "100"), "--nodes 100 x --gpus-per-node 8 = 800 GPUs, but the layout "
                         "tp=8 x pp=16 x dp=8 needs 1024 (one process per GPU): use --nodes 128"),
])
def test_mismatches_are_clear_errors(args, message):
    proc = dry_run("+recipe=gpt3-175b", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_layout_errors_from_validation_are_reported():
    proc = dry_run("+recipe=gpt3-175b", "model.pad_vocab_to=1")
    assert proc.returncode == 2 and "not divisible by parallel.tp=8" in proc.stderr


def test_cpu_cluster_script_uses_processes_and_cluster_env():
    proc = dry_run("+recipe=tiny-zero3", "cluster=local")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "#SBATCH --cpus-per-task=2" in lines and "#SBATCH --partition=local" in lines
    assert not any(line.startswith("#SBATCH --gpus") for line in lines)
    assert "NPROC_PER_NODE=2" in lines and "export GLOO_SOCKET_IFNAME=lo" in lines
    assert "#SBATCH --signal=B:USR1@60" in lines


def test_cluster_overrides_do_not_change_the_run_directory():
    assert compose_config(["+recipe=tiny", "cluster=local", "cluster.time=1:00:00"]).run_name \
        == "tiny"


# -- the batch script's logic, with stand-ins for srun and scontrol -------------------------

FAKE_SRUN = """#!/bin/bash
# stand-in for srun: record the command, then act as told by $FAKE_MODE
echo "$@" > "$FAKE_LOG/srun.args"
case "$FAKE_MODE" in
  exit*) exit "${FAKE_MODE#exit}" ;;
  wait-signal)  # like torchrun whose workers save on USR1: checkpoint, then exit 1
    trap 'mkdir -p "$RUN_DIR/checkpoints/step_0000005"; echo usr1 > "$FAKE_LOG/srun.signal"; exit 1' USR1
    touch "$FAKE_LOG/srun.started"
    for i in $(seq 200); do sleep 0.05; done; exit 0 ;;
  checkpoint-then-fail) mkdir -p "$RUN_DIR/checkpoints/step_0000009"; exit 1 ;;
  finish) echo '{}' > "$RUN_DIR/result.json"; exit 0 ;;
  stopped-json) echo '{"exit_code": 75}' > "$RUN_DIR/stopped.json"; exit 0 ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo node1; echo node2 ;;
  "requeue "*) echo "$2" > "$FAKE_LOG/requeued" ;;
esac
"""


def run_batch(tmp_path: Path, mode: str, restarts: int = 0, signal_after: bool = False
              ) -> tuple[int, Path, str]:
    bin_dir, log_dir, run_dir = tmp_path / "bin", tmp_path / "log", tmp_path / "run"
    for d in (bin_dir, log_dir, run_dir):
        d.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log_dir),
           "FAKE_MODE": mode, "RUN_DIR": str(run_dir), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_RESTART_COUNT": str(restarts), "NPROC_PER_NODE": "4", "MAX_REQUEUES": "3"}
    proc = subprocess.Popen(["bash", str(REPO / "slurm" / "train.sbatch"), "+recipe=tiny"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if signal_after:
        deadline = time.monotonic() + 20
        while not (log_dir / "srun.started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # what scancel --signal=USR1 --batch does
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, log_dir, out


def test_batch_script_starts_torchrun_on_every_node(tmp_path):
    rc, log, out = run_batch(tmp_path, "exit0")
    assert rc == 0 and not (log / "requeued").exists()
    args = (log / "srun.args").read_text()
    assert "--ntasks=2 --ntasks-per-node=1" in args
    assert "-m torch.distributed.run --nnodes=2 --nproc-per-node=4" in args
    assert "--rdzv-backend=c10d --rdzv-endpoint=node1:20042 --rdzv-id=42" in args
    assert "SIGUSR1" in args and args.strip().endswith("train.py +recipe=tiny")


def test_batch_script_forwards_usr1_and_requeues(tmp_path):
    rc, log, out = run_batch(tmp_path, "wait-signal", signal_after=True)
    assert (log / "srun.signal").read_text().strip() == "usr1"  # the trap reached srun
    assert (log / "requeued").read_text().strip() == "42"
    assert rc == 0 and "requeueing job 42" in out


@pytest.mark.parametrize("mode, restarts, requeued, rc", [
    ("exit75", 0, True, 0),                  # a worker's EX_TEMPFAIL, one process
    ("stopped-json", 0, True, 0),            # torchrun ranks stopped (time limit): exit 0
    ("checkpoint-then-fail", 0, True, 0),    # failed after saving new progress
    ("exit1", 0, False, 1),                  # a crash without progress: no requeue loop
    ("finish", 0, False, 0),                 # finished: never requeued
    ("exit75", 3, False, 75),                # MAX_REQUEUES reached
])
def test_batch_script_requeue_rules(tmp_path, mode, restarts, requeued, rc):
    got_rc, log, out = run_batch(tmp_path, mode, restarts=restarts)
    assert (log / "requeued").exists() == requeued, out
    assert got_rc == rc, out
