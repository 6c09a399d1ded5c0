"""Against a real Slurm of several nodes on this machine (slurm/local_cluster.sh start
--nodes 4: n1..n4, one slurmd each): tools/launch.py runs a 2-node ZeRO-3 and a 4-node pp2 x DDP2
job (one rank a node, gloo; srun starts one torchrun a node, rendezvous on the first node)
that train to the losses of one process; and a node killed mid-run (its slurmd and its
ranks, -9) is named in one line, left out, and the job finishes on the node left from the
last complete checkpoint, with the losses of an uninterrupted run.

The cluster has its own state directory and ports (SLURM_LOCAL_DIR / SLURM_LOCAL_PORT /
SLURM_LOCAL_DB_PORT below), so it runs beside the one-node cluster of tests/test_slurm.py;
it is held under a machine-wide lock while used (pytest-xdist workers take turns), started
if none runs and stopped by whoever started it. Skips, saying why, without Slurm;
PRETRAIN_REQUIRE_SLURM=1 makes that a failure.

Two 2-node jobs run at once where they are independent (the reference run beside the
preempted one, the lost node's run beside the cut one: n1-n4 hold both), each on the nodes
Slurm gave it, and the fault goes to that job's second node. A run slowed on purpose
(``PRETRAIN_FAULT=slow``: time to put the fault in mid-run) goes at full speed once the fault
is in (``PRETRAIN_FAULT_UNTIL``).
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from built_once import built_once
from helpers import (
    CORPUS_FILES,
    DATA_NAME,
    REPO,
    TOKENIZER_VOCAB,
    by_step,
    compose_config,
    one_thread,
    read_metrics,
    read_result,
)
from slurm_cluster import TERMINAL, job_info, launch, sbin_path, unavailable, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLUSTER = REPO / "slurm" / "local_cluster.sh"
NODES = 4
CLUSTER_ENV = {"SLURM_LOCAL_DIR": os.environ.get("PRETRAIN_SLURM_NODES_DIR",
                                                 "/tmp/pretrain-slurm-nodes"),
               "SLURM_LOCAL_PORT": "7817", "SLURM_LOCAL_DB_PORT": "3407"}
LOCK = "/tmp/pretrain-slurm-nodes.lock"
GLOO_IF = "PRETRAIN_TEST_GLOO_IF"  # in the fixture's environment: eth0 with --netns, else lo
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sbatch")


def cluster(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _skip_or_fail(msg: str) -> None:
    if os.environ.get("PRETRAIN_REQUIRE_SLURM") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, str]]:
    """A running 4-node local cluster, this process's alone while the module runs; yields
    the environment that reaches it (SLURM_CONF)."""
    reason = unavailable(CLUSTER, DAEMONS)
    if reason:
        _skip_or_fail(reason)
    env = {**os.environ, "PATH": sbin_path(), **CLUSTER_ENV}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "PRETRAIN_FAULT"):
        env.pop(key, None)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the module is done with the cluster
        already = cluster(env, "status").returncode == 0
        if not already:  # each node a network namespace of its own where this host allows
            proc = cluster(env, "start", "--nodes", str(NODES), "--netns", timeout=300)
            if proc.returncode:
                cluster(env, "stop")
                proc = cluster(env, "start", "--nodes", str(NODES), timeout=300)
            if proc.returncode:
                cluster(env, "stop")
                _skip_or_fail(f"slurm/local_cluster.sh start --nodes {NODES} failed:\n"
                              f"{proc.stderr[-3000:]}")
        env["SLURM_CONF"] = cluster(env, "env").stdout.strip().split("=", 1)[1]
        netns = Path(env["SLURM_LOCAL_DIR"], "netns")
        # gloo on the interface the nodes reach each other by
        env[GLOO_IF] = "eth0" if netns.exists() and netns.read_text().strip() == "1" else "lo"
        try:
            yield env
        finally:
            if not already:
                cluster(env, "stop")


def data_overrides(work_dir: Path) -> list[str]:
    """The conftest corpus, prepared by the ``prepared`` fixture: jobs only read it."""
    return ["model.vocab_size=300", "data.source=text", f"data.name={DATA_NAME}",
            f"data.data_files=[{','.join(CORPUS_FILES)}]",
            f"data.tokenizer_vocab_size={TOKENIZER_VOCAB}", "data.validation_fraction=0.1",
            "data.num_proc=1", f"data.root={work_dir / 'data'}"]


def run_args(work_dir: Path, runs: Path, name: str, steps: int, parallel: str = "zero3",
             interval: int | None = None) -> list[str]:
    """The nano model in fp32, one rank a node, the data-parallel size taken from the nodes
    (parallel.dp=null): the global batch of 8 stays 8 on any number of nodes (more
    accumulation on fewer)."""
    return ["+recipe=tiny-zero3", "cluster=local", "model=nano", "precision=fp32",
            f"parallel={parallel}", "parallel.dp=null", "cluster.procs_per_node=1",
            *data_overrides(work_dir), f"runs_dir={runs}", f"run_name={name}", "budget=steps",
            f"budget.steps={steps}", "train.global_batch_size=8", "parallel.micro_batch_size=2",
            "schedule.warmup_steps=2", "train.eval_batches=2", f"train.eval_interval={steps}",
            "train.sample_tokens=0", "logging=quiet", "logging.log_interval=1",
            "checkpoint.enabled=true", f"checkpoint.interval_steps={interval or steps}",
            "checkpoint.async_save=false"]


def one_process(work_dir: Path, runs: Path, name: str, steps: int, **kw) -> dict[int, float]:
    """The same run in one process, here (pretrain.train.trainer.run, what train.py calls):
    its losses by step."""
    from pretrain.train.trainer import run

    args = [a for a in run_args(work_dir, runs, name, steps, **kw)
            if not a.startswith(("cluster.", "parallel="))] + ["parallel=single"]
    cfg = compose_config(args)
    cwd = os.getcwd()
    os.chdir(work_dir)
    try:
        with one_thread():
            assert run(cfg, runs / name)["exit_code"] == 0
    finally:
        os.chdir(cwd)
    return by_step(runs / name)


def submit(args: list[str], cwd: Path, env: dict[str, str]) -> int:
    out = launch([*args, f"cluster.env.GLOO_SOCKET_IFNAME={env[GLOO_IF]}"], cwd, env)
    match = re.search(r"submitted job (\d+)", out)
    assert match, out
    return int(match.group(1))


def together(*calls: tuple) -> list[tuple[Any, BaseException | None]]:
    """Each ``(function, *args)`` in a thread of its own, all of them waited for: what each
    returned or raised (``outcome`` gives it to the test that asks, raising it there)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(*call) for call in calls]
    return [(None, f.exception()) if f.exception() else (f.result(), None) for f in futures]


def outcome(done: tuple[Any, BaseException | None]) -> Any:
    value, error = done
    if error is not None:
        raise error
    return value


def hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    """``n[1-2]`` -> ``["n1", "n2"]``."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, check=True,
                          capture_output=True, text=True).stdout.split()


def job_nodes(job: int, env: dict[str, str]) -> list[str]:
    """The nodes of a running job, the batch script's (the rendezvous) first."""
    return hostnames(job_info(job, env)["NodeList"], env)


def wait_until(done: Callable[[], bool], job: int, env: dict[str, str], what: str,
               timeout: float = 240) -> None:
    """Poll ``done`` while the job runs; fail naming ``what`` if it ends or time runs out."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not in {timeout} s: {job_info(job, env)}"
        assert job_info(job, env).get("JobState") not in TERMINAL, f"finished before {what}"
        time.sleep(0.1)


def wait_past_checkpoint(run: Path, interval: int, job: int, nodes: dict[str, str]) -> None:
    """Until the run has saved its step-``interval`` checkpoint and taken a step past it."""
    wait_until(lambda: (run / "checkpoints" / f"step_{interval:07d}" / "meta.json").exists()
               and any(m.get("step", 0) > interval for m in read_metrics(run)),
               job, nodes, f"a step after {interval}")


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: list[int]):
    """fp32, the tolerance of the re-layout tests (tests/test_relayout.py)."""
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-4, (step, got, want)


TWO_NODE_STEPS = 8


def reference_run(env: dict[str, str], work_dir: Path, runs: Path) -> tuple[int, Path]:
    """A 2-node ZeRO-3 run, uninterrupted: (job, run dir)."""
    job = submit([*run_args(work_dir, runs, "nodes", TWO_NODE_STEPS), "--nodes=2"], work_dir,
                 env)
    wait_job(job, env)
    return job, runs / "nodes"


def preempted_run(env: dict[str, str], work_dir: Path, runs: Path) -> dict:
    """The reference run given USR1 after its step 2 (rank 0 slowed to 0.6 s a step until
    a rank has the signal), with wandb offline: its job, final record, log and run dir."""
    runs.mkdir(parents=True)
    env = {**env, "PRETRAIN_FAULT": "slow:rank=0:seconds=0.6",  # time to signal it
           "PRETRAIN_FAULT_UNTIL": str(runs / "signalled")}
    job = submit([*run_args(work_dir, runs, "preempted", TWO_NODE_STEPS), "--nodes=2",
                  "train.stop_check_interval=1",  # a stop seen the next step
                  "logging.wandb=offline"], work_dir, env)
    run, out = runs / "preempted", runs / "preempted" / f"slurm-{job}.out"
    wait_until(lambda: any(m.get("step", 0) >= 2 for m in read_metrics(run)), job, env,
               "step 2")
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=env, check=True)
    wait_until(lambda: "received SIGUSR1" in out.read_text(), job, env, "the signal")
    Path(env["PRETRAIN_FAULT_UNTIL"]).touch()  # the stop is agreed at the step's end
    info = wait_job(job, env, timeout=300)
    return {"job": job, "info": info, "log": out.read_text(), "run": run}


@pytest.fixture(scope="module")
def first_pair(nodes, work_dir, prepared, tmp_path_factory) -> list:
    """The reference run and the preempted one, at once (two nodes each); once a pytest run
    (tests/built_once.py), whichever workers its tests land on."""
    return built_once(tmp_path_factory, "slurm-first-pair", lambda folder: together(
        (reference_run, nodes, work_dir, folder / "ref" / "runs"),
        (preempted_run, nodes, work_dir, folder / "pre" / "runs")))


def check_across_nodes(job: int, run: Path, n: int, want: dict[int, float],
                       env: dict[str, str], dp: int = 0) -> None:
    log = (run / f"slurm-{job}.out").read_text()
    assert "training exited with 0 (finished: 1" in log, log[-4000:]
    start = re.search(rf"job {job} \(restart 0\) on {n} node\(s\) \[(\S+)\] x 1 processes"
                      r".*, rendezvous on (\w+)", log)
    assert start, log[:2000]
    names = hostnames(start[1], env)
    assert len(set(names)) == n and start[2] == names[0], start[0]  # on the job's first
    plan = (run / "plan.json").read_text()
    assert f'"world_size": {n}' in plan and f'"dp": {dp or n}' in plan, plan
    assert_same_losses(by_step(run), want, sorted(want))


def test_a_two_node_zero3_run_equals_one_process(first_pair, nodes, work_dir, tmp_path):
    job, run = outcome(first_pair[0])
    check_across_nodes(job, run, 2, one_process(work_dir, tmp_path, "one", TWO_NODE_STEPS),
                       nodes)


def test_a_four_node_pipeline_of_ddp_equals_one_process(nodes, work_dir, prepared, tmp_path):
    """pp=2 x dp=2 (DDP) on four nodes: each pipeline stage's send and receive, and each
    stage's gradient all-reduce, cross nodes."""
    steps, runs = 4, tmp_path / "runs"
    job = submit([*run_args(work_dir, runs, "nodes", steps, "pp2"), "parallel.dp_mode=ddp",
                  "--nodes=4"], work_dir, nodes)
    want = one_process(work_dir, runs, "one", steps)  # while the job starts
    wait_job(job, nodes)
    check_across_nodes(job, runs / "nodes", 4, want, nodes, dp=2)
    assert '"pp": 2' in (runs / "nodes" / "plan.json").read_text()


def test_a_preempted_two_node_job_resumes_bit_identically(first_pair):
    """SIGUSR1 to the batch script (what --signal=B:USR1 does before the time limit): srun
    passes it to both nodes' torchrun, every rank saves, the job requeues itself and the
    rerun on two nodes gives the uninterrupted run's losses bit for bit, and its final
    validation loss; one wandb run across both attempts. (It also covers what
    tests/test_slurm.py's single-node preemption test asserted, merged here; the signal's
    way to two workers on one node: test_usr1_reaches_the_workers_and_the_job_requeues.)"""
    ran = outcome(first_pair[1])
    job, info, log, run = ran["job"], ran["info"], ran["log"], ran["run"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    assert "SIGUSR1: asking every rank" in log and f"requeueing job {job}" in log
    assert re.search(rf"job {job} \(restart 1\) on 2 node\(s\) \[{re.escape(info['NodeList'])}\]",
                     log), log[-4000:]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved[0] < f"step_{TWO_NODE_STEPS:07d}"  # the preemption's save, before the end
    reference = outcome(first_pair[0])[1]
    assert by_step(run, pattern="metrics*.jsonl") == by_step(reference)  # resumed exactly
    assert read_result(run)["steps"] == TWO_NODE_STEPS
    assert read_result(run)["final_val_loss"] == pytest.approx(
        read_result(reference)["final_val_loss"], abs=1e-4)
    # one training run, one wandb run: both attempts report wandb's id for their run (Run.id),
    # the run directory's; the offline folders' names are wandb's business (issue 62)
    run_id = (run / "wandb_id").read_text().strip()
    assert re.findall(r"wandb run (\w+) \(offline\)", log) == [run_id, run_id], log[-4000:]
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2


@pytest.fixture(scope="module")
def one_of_12(work_dir, prepared, tmp_path_factory) -> dict[int, float]:
    """The losses of one uninterrupted process for the lost-node and cut tests' run."""
    return one_process(work_dir, tmp_path_factory.mktemp("one12"), "one", 12, interval=4)


def faulted_run(env: dict[str, str], work_dir: Path, runs: Path, name: str,
                fault: tuple[str, str], timeout_s: int) -> dict:
    """A 2-node run of 12 steps, a checkpoint every 4, rank 0 slowed to 0.4 s a step until
    ``fault`` (``("kill-node", "revive-node")`` or the cut's pair) has hit the job's second
    node after the step-4 checkpoint, undone once the job is over; the srun of the lost
    node not waited for past 1 s (LOST_GRACE). Its final record, log, run dir and nodes."""
    runs.mkdir(parents=True)
    released = runs / "fault_in"
    env = {**env, "PRETRAIN_FAULT": "slow:rank=0:seconds=0.4",  # time to put it in mid-run
           "PRETRAIN_FAULT_UNTIL": str(released), "LOST_GRACE": "1"}
    job = submit([*run_args(work_dir, runs, name, 12, interval=4), "--nodes=2",
                  f"comm.train_timeout_s={timeout_s}"], work_dir, env)
    run = runs / name
    wait_past_checkpoint(run, 4, job, env)
    names = job_nodes(job, env)
    try:
        hit = cluster(env, fault[0], names[1])
        assert hit.returncode == 0, hit.stderr
        released.touch()
        info = wait_job(job, env, timeout=300)
    finally:
        undone = cluster(env, fault[1], names[1], timeout=120)
    assert undone.returncode == 0, undone.stderr
    return {"info": info, "log": (run / f"slurm-{job}.out").read_text(), "run": run,
            "nodes": names}


CUT_TIMEOUT_S = 6  # comm.train_timeout_s of the cut run: a step here takes well under 1 s


@pytest.fixture(scope="module")
def second_pair(nodes, work_dir, prepared, one_of_12, tmp_path_factory) -> list:
    """The lost node's run (hang.py's wait for the others' word: 2 s under a 20-s timeout)
    and, where the nodes have network namespaces, the cut one, at once; once a pytest run."""
    def build(folder: Path) -> list:
        lost = (faulted_run, nodes, work_dir, folder / "lost" / "runs", "lost",
                ("kill-node", "revive-node"), 20)
        if nodes[GLOO_IF] != "eth0":
            return [*together(lost), None]
        return together(lost, (faulted_run, nodes, work_dir, folder / "cut" / "runs", "cut",
                               ("cut-node", "restore-node"), CUT_TIMEOUT_S))

    return built_once(tmp_path_factory, "slurm-second-pair", build)


def test_a_lost_node_is_left_out_and_the_run_finishes(second_pair, one_of_12):
    """Two nodes; the second (n2 when the job has n1 and n2) killed (slurmd and ranks,
    SIGKILL) after the step-4 checkpoint: the rank left names it and its rank in one line,
    the job gives it back and goes on with the first alone from step 4 (dp 1, four
    microbatches a step), at most one interval redone, and every step after the checkpoint
    has the loss of one uninterrupted process."""
    ran = outcome(second_pair[0])
    info, log, run, (first, second) = ran["info"], ran["log"], ran["run"], ran["nodes"]
    steps, interval = 12, 4
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    hang = [line for line in log.splitlines() if "did not arrive" in line]
    # the rendezvous numbers the nodes as they arrive: the second node's rank is 0 or 1
    assert hang and re.search(rf"rank\(s\) \[(\d)\] did not arrive \(node {second}: rank "
                              r"\1\); exit 76", hang[0]), log[-5000:]
    before, lost = log.split(f"lost node(s) {second} (training exited with ", 1)
    resumed = re.match(rf"\d+\); continuing on \[{first}\] from \S+/step_(\d+)", lost)
    assert resumed, lost[:500]
    assert f"restart 1 on 1 node(s) [{first}]" in lost
    assert re.search(rf"rank \d is a straggler \(on ({first}|{second})\)", before)  # named
    # at most one checkpoint interval redone: the steps the first attempt took past the
    # checkpoint it resumed from
    done = [int(s) for s in re.findall(r"step (\d+)/\d+ \| loss", before)]
    assert 0 <= max(done) - int(resumed.group(1)) <= interval, (done, resumed.group(1))
    assert re.search(r'"dp": 1, .*"grad_accum": 4', lost)  # one rank, 4 microbatches a step
    assert read_result(run)["steps"] == steps
    assert_same_losses(by_step(run), one_of_12, list(range(int(resumed.group(1)) + 1,
                                                          steps + 1)))


def test_a_node_cut_off_is_named_after_the_timeout_and_left_out(second_pair, one_of_12):
    """Two nodes in network namespaces; the second one's link cut after the step-4
    checkpoint (it and its rank live on, unreachable: no connection closes): the rank on
    the first waits comm.train_timeout_s, names the cut node in one line, and the job goes
    on with the first alone to the losses of one uninterrupted process."""
    if second_pair[1] is None:
        pytest.skip("the cluster's nodes share one network (this host refused network "
                    "namespaces: ip netns, unshare), so no link can be cut")
    ran = outcome(second_pair[1])
    info, log, run, (first, second) = ran["info"], ran["log"], ran["run"], ran["nodes"]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    assert re.search(rf"within {CUT_TIMEOUT_S} s \(comm\.train_timeout_s\): rank\(s\) "
                     rf"\[(\d)\] did not arrive \(node {second}: rank \1\); exit 76",
                     log), log[-5000:]
    resumed = re.search(rf"lost node\(s\) {second} \(training exited with \d+\); continuing "
                        rf"on \[{first}\] from \S+/step_(\d+)", log)
    assert resumed, log[-5000:]
    assert read_result(run)["steps"] == 12
    assert_same_losses(by_step(run), one_of_12, list(range(int(resumed.group(1)) + 1, 13)))


STUB_LOSER = """
import os, pathlib, sys
# Stands in for train.py under torchrun, one rank a node: every attempt 'loses' its last
# node (rank 0 names it where train/hang.py would) and the ranks exit 76, as after a hang.
world = int(os.environ["WORLD_SIZE"])
if os.environ["RANK"] == "0":
    pathlib.Path(os.environ["PRETRAIN_LOST_NODES_FILE"]).write_text(f"n{world}\\n")
    print(f"attempt on {world} node(s)", flush=True)
sys.exit(76)
"""


def test_a_job_that_loses_node_after_node_gives_up_in_one_line(nodes, tmp_path):
    """slurm/train.sbatch by hand with a stub that loses a node on every attempt: three
    nodes, MAX_NODE_LOSSES=1: it goes on without n3, then stops with one line when n2 goes
    too, and is not requeued."""
    run = tmp_path / "run"
    run.mkdir()
    stub = tmp_path / "stub_loser.py"
    stub.write_text(STUB_LOSER)
    env = {**nodes, "RUN_DIR": str(run), "NPROC_PER_NODE": "1", "PYTHON": sys.executable,
           "TRAIN_PY": str(stub), "GLOO_SOCKET_IFNAME": "lo", "ELASTIC": "1",
           "MAX_NODE_LOSSES": "1"}
    out = subprocess.run(["sbatch", "--parsable", "--nodes=3", f"--output={run}/slurm-%j.out",
                          str(REPO / "slurm" / "train.sbatch")],
                         env=env, capture_output=True, text=True, check=True).stdout
    job = int(out.strip().split(";")[0])
    info = wait_job(job, nodes, timeout=180)
    log = (run / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log[-3000:]
    assert "attempt on 3 node(s)" in log and "continuing on [n1,n2]" in log
    assert "attempt on 2 node(s)" in log and "attempt on 1 node(s)" not in log
    gave_up = [line for line in log.splitlines() if "giving up" in line]
    assert len(gave_up) == 1 and gave_up[0].endswith(
        "lost node(s) n2; giving up: 2 nodes lost in this job (n3 n2), more than "
        "MAX_NODE_LOSSES=1; not requeued"), log[-3000:]
    assert "requeueing" not in log


def test_a_node_lost_under_torchft_costs_no_restart_and_heals(nodes, work_dir, prepared,
                                                             tmp_path):
    """ft.mode=torchft: two replica groups, a job and a node each (slurm/ft_group.sbatch),
    the Lighthouse in this process (the login node's place). n2 is killed mid-run: group 0
    trains on without a restart (its job never requeued, at most the one step the failure
    spoiled taken again); n2 revived, group 1 comes back in a new job there (Slurm's own
    requeue of the dead job takes about a minute here: slurmctld has to learn the job is
    gone), heals from group 0 at its first step, and both end with bit-identical parameters
    and optimizer state. Both groups take 0.25 s a step until group 1 has healed (150 steps,
    about 38 s, for n2's return: it took 6.6 s here), then go at full speed (0.04 s a step)."""
    pytest.importorskip("torchft")
    from test_fault_tolerance import assert_identical, ft_args, lighthouse, saved_state

    steps, runs, healed_file = 160, tmp_path / "runs", tmp_path / "healed"
    env = {**nodes, "PRETRAIN_FAULT": "slow:rank=0:seconds=0.25", "PYTHON": sys.executable,
           "PRETRAIN_FAULT_UNTIL": str(healed_file), "TRAIN_PY": str(REPO / "train.py")}
    run = runs / "ft"
    run.mkdir(parents=True)

    def group(g: int, node: str, address: str) -> int:
        out = subprocess.run(
            ["sbatch", "--parsable", "--no-requeue", f"--nodelist={node}",
             f"--output={run}/slurm-%j.out", str(REPO / "slurm" / "ft_group.sbatch"),
             *ft_args(work_dir, runs, steps, address, interval=20)],
            env={**env, "PRETRAIN_FT_GROUP": str(g), "TORCHFT_LIGHTHOUSE": address},
            cwd=work_dir, capture_output=True, text=True, check=True).stdout
        return int(out.strip().split(";")[0])

    with lighthouse(min_replicas=1) as address:
        jobs = [group(0, "n1", address), group(1, "n2", address)]
        deadline = time.monotonic() + 180
        while not any(m.get("step", 0) >= 10 for m in read_metrics(run / "group1")):
            assert time.monotonic() < deadline, f"no step 10: {job_info(jobs[1], nodes)}"
            time.sleep(0.2)
        try:
            killed = cluster(nodes, "kill-node", "n2")
            assert killed.returncode == 0, killed.stderr
            # its node died under it: cancelled first, or n2 stays allocated to it (and
            # revive-node waits for idle) until slurmctld learns the job is gone
            subprocess.run(["scancel", str(jobs[1])], env=nodes)
        finally:
            revived = cluster(nodes, "revive-node", "n2", timeout=120)
        assert revived.returncode == 0, revived.stderr
        jobs.append(group(1, "n2", address))
        back = run / f"slurm-{jobs[2]}.out"
        deadline = time.monotonic() + 180
        while not (back.exists() and "torchft: healed" in back.read_text()):  # else: below
            if (time.monotonic() > deadline
                    or job_info(jobs[0], nodes).get("JobState") in TERMINAL):
                break
            time.sleep(0.1)
        healed_file.touch()
        infos = [wait_job(job, nodes, timeout=240) for job in (jobs[0], jobs[2])]
    logs = [(run / f"slurm-{job}.out").read_text() for job in (jobs[0], jobs[2])]
    assert infos[0]["JobState"] == "COMPLETED" and infos[0]["Restarts"] == "0", logs[0][-4000:]
    assert infos[1]["JobState"] == "COMPLETED", logs[1][-4000:]
    assert "torchft: 1 replica group(s) in this step's quorum (was 2)" in logs[0], logs[0][-4000:]
    assert logs[0].count("not committed") <= 1
    healed = re.search(r"torchft: healed from a live peer at step (\d+)", logs[1])
    assert healed and int(healed.group(1)) > 10, logs[1][-4000:]
    # group 0 never restarted: each of its steps logged once, from its first (a group that
    # starts after the other heals at the other's step, as a returning one does) to the end
    taken = [m["step"] for m in read_metrics(run / "group0") if "loss" in m]
    assert taken == list(range(taken[0], steps + 1)) and taken[0] <= 10, taken
    final = f"checkpoints/step_{steps:07d}"
    assert_identical(saved_state(run / "group1" / final, tmp_path),
                     saved_state(run / "group0" / final, tmp_path))
