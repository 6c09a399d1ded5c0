"""Against a real Slurm (slurm/local_cluster.sh: one node, this machine): tools/launch.py
submits the jobs that prepare unprepared data and, after them, a 2-process gloo run that
trains on it (one launch, looked at by three tests); a preemption signal reaches both
workers through srun and torchrun, and the job requeues itself and finishes; a Hydra
multirun of the tiny ladder through the submitit launcher runs each point as a Slurm job.
(A real run preempted, saved, requeued and resumed to the uninterrupted run's losses, with
one wandb run across both attempts: tests/test_slurm_nodes.py's
test_a_preempted_two_node_job_resumes_bit_identically, which took over this module's
single-node preemption test.)

The module holds the cluster while its tests run (tests/slurm_cluster.py: one process a
machine at a time, so `pytest -n auto` workers take turns): an already running one is used,
as CI does, or one is started and stopped at the end. Without Slurm, and no way to
install it (root + apt-get), the tests skip and say why; PRETRAIN_REQUIRE_SLURM=1 turns
that skip into a failure, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from helpers import CORPUS_FILES, DATA_NAME, REPO, TOKENIZER_VOCAB, read_metrics, read_result
from slurm_cluster import (
    ClusterStartError,
    held_cluster,
    job_info,
    launch,
    sbin_path,
    unavailable,
)
from slurm_cluster import wait_job as wait_any_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLUSTER = REPO / "slurm" / "local_cluster.sh"
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct")


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    """A running local cluster, held by this process alone while the module's tests run
    (tests/slurm_cluster.py: other workers wait); yields the environment that reaches it."""
    reason = unavailable(CLUSTER, DAEMONS)
    if reason:
        if os.environ.get("PRETRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(f"PRETRAIN_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    env = {**os.environ, "PATH": sbin_path()}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        with held_cluster(CLUSTER, env) as conf:
            yield {**env, "SLURM_CONF": conf}
    except ClusterStartError as e:
        if os.environ.get("PRETRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))


def data_overrides(work_dir: Path) -> list[str]:
    """The conftest corpus, already prepared by the ``prepared`` fixture (same fingerprint),
    so concurrent jobs only read it."""
    return ["model.vocab_size=300", "data.source=text", f"data.name={DATA_NAME}",
            f"data.data_files=[{','.join(CORPUS_FILES)}]",
            f"data.tokenizer_vocab_size={TOKENIZER_VOCAB}", "data.validation_fraction=0.1",
            "data.num_proc=1", f"data.root={work_dir / 'data'}"]


def gloo_run(work_dir: Path, runs: Path, name: str, steps: int) -> list[str]:
    """A 2-process FSDP run of the nano model: the tiny-zero3 recipe, shrunk."""
    return ["+recipe=tiny-zero3", "cluster=local", "model=nano", *data_overrides(work_dir),
            f"runs_dir={runs}", f"run_name={name}", "budget=steps", f"budget.steps={steps}",
            "train.global_batch_size=8", "parallel.micro_batch_size=4", "train.eval_batches=2",
            f"train.eval_interval={steps}", "train.sample_tokens=0", "logging=quiet",
            "logging.log_interval=1", "checkpoint.enabled=true",
            f"checkpoint.interval_steps={steps}", "checkpoint.async_save=false"]


def why(job: int | str, env: dict[str, str]) -> str:
    """What a failed wait shows: the job's state and reason, and the node's."""
    info = job_info(job, env)
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %C %E"], env=env,
                          capture_output=True, text=True).stdout.strip()
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T %R %C"], env=env,
                           capture_output=True, text=True).stdout.strip()
    return (f"job {job}: {info.get('JobState')} ({info.get('Reason')}); node: {node}; "
            f"queue: {queue}")


def wait_job(job: int, env: dict[str, str], timeout: float = 300) -> dict[str, str]:
    """slurm_cluster.wait_job, a timeout naming the node and the queue (``why``)."""
    return wait_any_job(job, env, timeout, describe=why)


def sacct_states(jobs: list[str], env: dict[str, str], timeout: float = 30) -> dict[str, str]:
    """Job id -> state from the accounting database (written asynchronously: poll)."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j",
                              ",".join(jobs)], env=env, capture_output=True, text=True).stdout
        states = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        if all(states.get(j) == "COMPLETED" for j in jobs) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


SUBMIT_STEPS = 8


@pytest.fixture(scope="module")
def submitted(slurm, work_dir, tmp_path_factory) -> dict:
    """One short 2-process run submitted with tools/launch.py on data not prepared yet (a
    data root of its own), so the launch chains the preparation jobs before it; waited for.
    Its job, run dir, final scontrol record, data root and the launch's stdout, for the tests
    that inspect the training and the preparation (one training job for both: each took a
    job, its torchrun and two ranks' start-up, about 8 s)."""
    root = tmp_path_factory.mktemp("submit")
    data_root, runs = root / "data", root / "runs"
    out = launch([*gloo_run(work_dir, runs, "submit", SUBMIT_STEPS), f"data.root={data_root}"],
                 work_dir, slurm)
    match = re.search(r"submitted job (\d+)", out)
    assert match, out
    job = int(match.group(1))
    return {"job": job, "run": runs / "submit", "info": wait_job(job, slurm),
            "data_root": data_root, "stdout": out}


def test_launch_submits_a_two_process_gloo_run(slurm, submitted):
    job, run, info = submitted["job"], submitted["run"], submitted["info"]
    log = (run / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert (run / "train.sbatch").exists()
    assert f"job {job} (restart 0) on 1 node(s) [{os.uname().nodename.split('.')[0]}] x 2 " \
           "processes" in log
    assert "training exited with 0 (finished: 1" in log
    plan = json.loads((run / "plan.json").read_text())
    assert plan["layout"]["world_size"] == 2 and plan["layout"]["dp"] == 2
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, SUBMIT_STEPS + 1))
    result = read_result(run)
    assert result["steps"] == SUBMIT_STEPS
    assert result["final_val_loss"] < result["first_val_loss"]
    assert sacct_states([str(job)], slurm) == {str(job): "COMPLETED"}  # accounting works


def test_submitted_run_writes_a_checkpoint(submitted):
    assert submitted["info"]["JobState"] == "COMPLETED"
    assert (submitted["run"] / "checkpoints" / f"step_{SUBMIT_STEPS:07d}").is_dir()


def test_launch_prepares_the_data_in_jobs_then_trains(slurm, submitted):
    """Unprepared data: tools/launch.py submits plan -> 2 encode tasks -> merge, and the
    training job after them; every job completes and training reads what they wrote."""
    out, info, run = submitted["stdout"], submitted["info"], submitted["run"]
    prep = re.search(r"preparation jobs plan (\d+), encode (\d+) \(array of 2\), merge (\d+)",
                     out)
    job = re.search(r"submitted job (\d+): .*after preparation job (\d+)", out)
    assert prep and job and job.group(2) == prep.group(3), out
    logs = {p.name: p.read_text() for p in run.glob("*.out")}
    assert info["JobState"] == "COMPLETED", logs
    plan, encode, merge = prep.groups()
    jobs = [plan, f"{encode}_0", f"{encode}_1", merge, job.group(1)]
    assert sacct_states(jobs, slurm) == {j: "COMPLETED" for j in jobs}
    index = submitted["data_root"] / DATA_NAME / "index.json"
    assert json.loads(index.read_text())["splits"]["train"]
    # written by the merge job, before training started (which then only read it)
    assert index.stat().st_mtime <= datetime.fromisoformat(info["StartTime"]).timestamp() + 1
    assert read_result(run)["steps"] == SUBMIT_STEPS


STUB_WORKER = """
import os, signal, sys, time, json, pathlib
# Stands in for train.py under torchrun: stops on SIGUSR1 with a 'checkpoint' and exit 75,
# and after the requeue 'resumes' from it and finishes.
run = pathlib.Path(sys.argv[1])
rank, restart = int(os.environ["RANK"]), int(os.environ.get("SLURM_RESTART_COUNT", "0"))
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
(run / f"started.{restart}.{rank}").touch()  # its handler is in
if restart == 0:
    for _ in range(1200):
        if stop:
            if rank == 0:
                (run / "checkpoints" / "step_0000003").mkdir(parents=True)
            sys.exit(75)
        time.sleep(0.1)
    sys.exit(1)
if rank == 0:
    ckpt = sorted((run / "checkpoints").iterdir())[-1].name
    (run / "result.json").write_text(json.dumps({"resumed_from": ckpt}))
"""


def test_usr1_reaches_the_workers_and_the_job_requeues(slurm, tmp_path):
    """slurm/train.sbatch by hand, with a stub for train.py: SIGUSR1 to the batch shell
    goes through srun and torchrun to both workers, which 'save' and exit 75; the job
    requeues itself, reruns with SLURM_RESTART_COUNT=1 and finishes."""
    run = tmp_path / "run"
    run.mkdir()
    stub = tmp_path / "stub_worker.py"
    stub.write_text(STUB_WORKER)
    env = {**slurm, "RUN_DIR": str(run), "NPROC_PER_NODE": "2", "PYTHON": sys.executable,
           "TRAIN_PY": str(stub), "SHUTDOWN_TIMEOUT": "60", "GLOO_SOCKET_IFNAME": "lo"}
    out = subprocess.run(["sbatch", "--parsable", "--partition=local", "--nodes=1",
                          "--cpus-per-task=2", f"--output={run}/slurm-%j.out",
                          str(REPO / "slurm" / "train.sbatch"), str(run)],
                         env=env, capture_output=True, text=True, check=True).stdout
    job = int(out.strip().split(";")[0])
    deadline = time.monotonic() + 120
    while not all((run / f"started.0.{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, why(job, slurm)
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm, check=True)
    info = wait_job(job, slurm, timeout=300)
    log = (run / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert "SIGUSR1: asking every rank" in log and f"requeueing job {job}" in log
    assert f"job {job} (restart 1)" in log and (run / "started.1.0").exists()
    assert read_result(run) == {"resumed_from": "step_0000003"}


def test_hydra_multirun_of_the_tiny_ladder_through_submitit(slurm, work_dir, prepared,
                                                            tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher (the slurm extra) is not installed")
    # the widest first: two tasks at a time (a CPU each), the quickest one waits for a CPU
    widths = (48, 32, 16)
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "+recipe=ladder-tiny",
         f"model.d_model={','.join(map(str, widths))}", *data_overrides(work_dir),
         f"runs_dir={runs}", "hydra.sweep.subdir=d${model.d_model}",
         "hydra/launcher=submitit_slurm", "hydra.launcher.partition=local",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
         "hydra.launcher.timeout_min=10"],
        # one thread a task, as its one CPU allows (two teams of two threads on two cores
        # spin-wait for each other): what each pytest-xdist worker's environment says anyway
        cwd=work_dir, env={**slurm, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sweep = runs / "sweeps" / "ladder-tiny"
    n_params = set()
    for width in widths:
        point = sweep / f"d{width}"
        result = read_result(point)
        plan = json.loads((point / "plan.json").read_text())
        assert result["steps"] == plan["steps"] and result["final_val_loss"] > 0
        n_params.add(plan["n_params"])
    assert len(n_params) == len(widths)
    # each point ran as a task of one Slurm job array
    tasks = sorted(p.name for p in (sweep / ".submitit").iterdir()
                   if re.fullmatch(r"\d+_\d+", p.name))
    assert len(tasks) == len(widths), tasks
    states = sacct_states(tasks, slurm)
    assert states == {t: "COMPLETED" for t in tasks}, states
    # and the scaling-law tool fits and plots these real runs (its main, in this process)
    from pretrain.tools import scaling_law

    out = tmp_path / "fit"
    assert scaling_law.main([str(sweep), "--out", str(out), "--bootstrap", "20"]) == 0
    assert len(json.loads((out / "fit.json").read_text())["runs"]) == len(widths)
    assert (out / "loss_vs_compute.png").stat().st_size > 10_000
