"""tools/launch.py and slurm/train.sbatch without a cluster: allocations derived from
layouts, clear errors on mismatches, the rendered script, and the script's signal and
requeue logic run under bash with stand-ins for srun and scontrol."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, compose_config

from pretrain.launch import slurm
from pretrain.tools import launch

CONTAINER_VARS = ("CONTAINER_IMAGE", "APPTAINER_IMAGE", "CONTAINER_MOUNTS")


def dry_run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``tools/launch.py ARGS --dry-run`` in ``cwd``, run as its ``main`` in this process (no
    interpreter start-up each time; test_container_image_from_the_environment_and_clear_errors
    runs the real command line), with the container variables unset."""
    from hydra.core.hydra_config import HydraConfig

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.pop(k) for k in CONTAINER_VARS if k in os.environ}
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            try:
                rc = launch.main([*args, "--dry-run"])
            except SystemExit as e:  # argparse's own errors
                rc = e.code
    finally:
        os.environ.update(saved)
        HydraConfig.instance().cfg = None
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


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
    assert slurm.allocation(big) == slurm.Allocation(128, 8, 8)
    assert slurm.allocation(big, nodes=64, gpus_per_node=16) == slurm.Allocation(64, 16, 16)
    one = compose_config(["+recipe=gpt3-125m"])  # 1 process: a job smaller than a node
    assert slurm.allocation(one) == slurm.Allocation(1, 1, 1)
    ladder = compose_config(["+recipe=ladder-chinchilla"])  # dp=null: the allocation decides
    alloc = slurm.allocation(ladder, nodes=4)
    assert alloc == slurm.Allocation(4, 8, 8) and alloc.world_size == 32
    cpu = compose_config(["+recipe=tiny-zero3", "cluster=local"])
    assert slurm.allocation(cpu) == slurm.Allocation(1, 2, 0)


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
    assert "#SBATCH --exclusive" in lines and "#SBATCH --partition=local" in lines
    assert not any(line.startswith(("#SBATCH --gpus", "#SBATCH --cpus")) for line in lines)
    assert "NPROC_PER_NODE=2" in lines and "export GLOO_SOCKET_IFNAME=lo" in lines
    assert "CPUS_PER_TASK=${SLURM_CPUS_ON_NODE:-1}" in lines  # the whole node for torchrun
    assert "#SBATCH --signal=B:USR1@60" in lines


def test_container_options_render_into_the_job(tmp_path):
    plain = dry_run("+recipe=gpt3-1.3b", cwd=tmp_path)
    pyxis = dry_run("--container-image", "nvcr.io#org/pretrain:1", "+recipe=gpt3-1.3b",
                    "--container-mounts", "/scratch/hf:/hf", cwd=tmp_path)  # flags anywhere
    sif = dry_run("+recipe=gpt3-1.3b", "--apptainer-image", "/img/pretrain.sif", cwd=tmp_path)
    for proc in (plain, pyxis, sif):
        assert proc.returncode == 0, proc.stderr
    plain_lines = plain.stdout.splitlines()
    # without a container the job is what it was: the launching interpreter, and no image
    # among the settings launch.py fills in (the template's own defaults come after them)
    settings = plain_lines[plain_lines.index("set -uo pipefail"):
                           plain_lines.index("# Settings tools/launch.py fills in; by hand, "
                                             "the environment or these defaults apply.")]
    assert f"PYTHON={sys.executable}" in settings
    assert not [line for line in settings if line.startswith(CONTAINER_VARS)]
    # with one, the settings name the image and the image's python; nothing else changes
    def changed(proc):
        return (set(proc.stdout.splitlines()) - set(plain_lines),
                set(plain_lines) - set(proc.stdout.splitlines()))

    assert changed(pyxis) == ({"PYTHON=python", "CONTAINER_IMAGE='nvcr.io#org/pretrain:1'",
                               "CONTAINER_MOUNTS=/scratch/hf:/hf"}, {f"PYTHON={sys.executable}"})
    assert changed(sif) == ({"PYTHON=python", "APPTAINER_IMAGE=/img/pretrain.sif"},
                            {f"PYTHON={sys.executable}"})
    assert "in nvcr.io#org/pretrain:1" in pyxis.stderr
    path = tmp_path / "job.sbatch"
    path.write_text(pyxis.stdout)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_container_image_from_the_environment_and_clear_errors(tmp_path):
    env = {**os.environ, "APPTAINER_IMAGE": "/img/pretrain.sif"}  # sbatch passes it on
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "launch.py"), "+recipe=tiny",
                           "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "PYTHON=python" in proc.stdout.splitlines()
    both = dry_run("+recipe=tiny", "--container-image", "a.sqsh", "--apptainer-image", "b.sif")
    assert both.returncode == 2 and "exclude each other" in both.stderr and both.stdout == ""
    mounts = dry_run("+recipe=tiny", "--container-mounts", "/a:/b")
    assert mounts.returncode == 2 and "needs --container-image" in mounts.stderr


def test_cluster_overrides_do_not_change_the_run_directory():
    assert compose_config(["+recipe=tiny", "cluster=local", "cluster.time=1:00:00"]).run_name \
        == "tiny"


# -- the batch script's logic, with stand-ins for srun and scontrol -------------------------

FAKE_SRUN = """#!/bin/bash
# stand-in for srun: record the command, then act as told by $FAKE_MODE
echo "$@" > "$FAKE_LOG/srun.args"
env > "$FAKE_LOG/srun.env"
case "$FAKE_MODE" in
  exit*) exit "${FAKE_MODE#exit}" ;;
  wait-signal)  # like torchrun whose workers save on USR1: checkpoint, then exit 1
    trap 'mkdir -p "$RUN_DIR/checkpoints/step_0000005"
          echo usr1 > "$FAKE_LOG/srun.signal"; exit 1' USR1
    touch "$FAKE_LOG/srun.started"
    for i in $(seq 200); do sleep 0.05; done; exit 0 ;;
  checkpoint-then-fail) mkdir -p "$RUN_DIR/checkpoints/step_0000009"
                        echo '{}' > "$RUN_DIR/checkpoints/step_0000009/meta.json"; exit 1 ;;
  unfinished-save-then-fail) mkdir -p "$RUN_DIR/checkpoints/step_0000009.tmp"; exit 1 ;;
  finish) echo '{}' > "$RUN_DIR/result.json"; exit 0 ;;
  stopped-json) echo '{"exit_code": 75}' > "$RUN_DIR/stopped.json"; exit 0 ;;
  lose-node2)  # the first run's ranks name node2 as lost (train/hang.py); the next finishes
    if [[ ! -e $FAKE_LOG/srun.once ]]; then
      touch "$FAKE_LOG/srun.once"; echo node2 > "$PRETRAIN_LOST_NODES_FILE"; exit 1
    fi
    echo "$@" > "$FAKE_LOG/srun.args2"; echo '{}' > "$RUN_DIR/result.json"; exit 0 ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo node1; echo node2 ;;
  "requeue "*) echo "$2" > "$FAKE_LOG/requeued" ;;
  "update JobId="*) echo "$@" > "$FAKE_LOG/updated" ;;
esac
"""


def run_batch(tmp_path: Path, mode: str, restarts: int = 0, signal_after: bool = False,
              env_extra: dict[str, str] | None = None) -> tuple[int, Path, str]:
    bin_dir, log_dir, run_dir = tmp_path / "bin", tmp_path / "log", tmp_path / "run"
    work_dir = tmp_path / "work"  # the job's working directory (sbatch --chdir)
    for d in (bin_dir, log_dir, run_dir, work_dir):
        d.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log_dir),
           "FAKE_MODE": mode, "RUN_DIR": str(run_dir), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_RESTART_COUNT": str(restarts), "NPROC_PER_NODE": "4", "MAX_REQUEUES": "3"}
    for var in (*CONTAINER_VARS, "TRAIN_PY", "PYTHON", "CPUS_PER_TASK", "SLURM_CPUS_PER_TASK",
                "SLURM_CPUS_ON_NODE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        env.pop(var, None)
    env.update(env_extra or {})
    proc = subprocess.Popen(["bash", str(REPO / "slurm" / "train.sbatch"), "+recipe=tiny"],
                            cwd=work_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
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
    assert "--ntasks=2 --ntasks-per-node=1 --nodelist=node1,node2 --cpus-per-task=1" in args
    assert "-m torch.distributed.run --nnodes=2 --nproc-per-node=4" in args
    assert "--rdzv-backend=c10d --rdzv-endpoint=node1:20042 --rdzv-id=42" in args
    assert "SIGUSR1" in args and args.strip().endswith("train.py +recipe=tiny")
    # no container: torchrun is srun's command itself, as it always was
    assert args.startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=node1,node2 "
                           "--cpus-per-task=1 python -m torch.distributed.run ")
    assert "container" not in out


CONTAINERS = {  # variables of the job -> what srun must be given before torchrun
    "pyxis": ({"CONTAINER_IMAGE": "nvcr.io#org/pretrain:1", "CONTAINER_MOUNTS": "/hf:/cache"},
              "--container-image=nvcr.io#org/pretrain:1 "
              "--container-mounts={work}:{work},{repo}:{repo},{run}:{run},/hf:/cache "
              "--container-workdir={work} env PYTHONPATH={repo}/src "),
    "apptainer": ({"APPTAINER_IMAGE": "/img/pretrain.sif", "APPTAINER": "singularity"},
                  "singularity exec --nv --bind {work}:{work},{repo}:{repo},{run}:{run} "
                  "--pwd {work} /img/pretrain.sif env PYTHONPATH={repo}/src "),
}


@pytest.mark.parametrize("runtime", sorted(CONTAINERS))
def test_batch_script_runs_torchrun_in_a_container(tmp_path, runtime):
    env, prefix = CONTAINERS[runtime]
    rc, log, out = run_batch(tmp_path, "exit0",
                             env_extra={**env, "TRAIN_PY": str(REPO / "train.py")})
    assert rc == 0, out
    args = (log / "srun.args").read_text()
    # the work dir, the code and the run dir each mounted at its own path, then torchrun
    # with the image's python and the checkout's package first on its path
    expected = ("--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=node1,node2 "
                "--cpus-per-task=1 "
                + prefix.format(work=tmp_path / "work", repo=REPO, run=tmp_path / "run")
                + "python -m torch.distributed.run --nnodes=2 --nproc-per-node=4 ")
    assert args.startswith(expected), args
    assert args.strip().endswith(f"{REPO}/train.py +recipe=tiny")


def test_batch_script_mounts_each_directory_once(tmp_path):
    # the run dir inside the work dir and the code in the work dir: one mount covers all
    run_dir = tmp_path / "work" / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    rc, log, out = run_batch(tmp_path, "exit0", env_extra={
        "CONTAINER_IMAGE": "img.sqsh", "RUN_DIR": str(run_dir)})
    assert rc == 0, out
    work = tmp_path / "work"
    assert (f"--container-image=img.sqsh --container-mounts={work}:{work} "
            f"--container-workdir={work} env PYTHONPATH={work}/src python ") \
        in (log / "srun.args").read_text()


def test_batch_script_refuses_two_container_runtimes(tmp_path):
    rc, log, out = run_batch(tmp_path, "exit0", env_extra={
        "CONTAINER_IMAGE": "img.sqsh", "APPTAINER_IMAGE": "img.sif"})
    assert rc == 2 and "not both" in out
    assert not (log / "srun.args").exists()


@pytest.mark.parametrize("container", [{}, {"CONTAINER_IMAGE": "img.sqsh"},
                                       {"APPTAINER_IMAGE": "img.sif"}])
def test_batch_script_forwards_usr1_and_requeues(tmp_path, container):
    rc, log, out = run_batch(tmp_path, "wait-signal", signal_after=True, env_extra=container)
    assert (log / "srun.signal").read_text().strip() == "usr1"  # the trap reached srun
    assert (log / "requeued").read_text().strip() == "42"
    assert rc == 0 and "requeueing job 42" in out


@pytest.mark.parametrize("mode, restarts, requeued, rc", [
    ("exit75", 0, True, 0),                  # a worker's EX_TEMPFAIL, one process
    ("stopped-json", 0, True, 0),            # torchrun ranks stopped (time limit): exit 0
    ("checkpoint-then-fail", 0, True, 0),    # failed after saving new progress
    ("exit1", 0, False, 1),                  # a crash without progress: no requeue loop
    ("unfinished-save-then-fail", 0, False, 1),  # a save cut short is no progress either
    ("finish", 0, False, 0),                 # finished: never requeued
    ("exit75", 3, False, 75),                # MAX_REQUEUES reached
])
def test_batch_script_requeue_rules(tmp_path, mode, restarts, requeued, rc):
    got_rc, log, out = run_batch(tmp_path, mode, restarts=restarts)
    assert (log / "requeued").exists() == requeued, out
    assert got_rc == rc, out


def test_requeue_check_counts_complete_checkpoints_only(tmp_path):
    """The script's newest checkpoint is the newest complete step_NNNNNNN (meta.json
    written, renamed from .tmp), by number; unfinished saves and condemned ones are not."""
    ckpts = tmp_path / "run" / "checkpoints"
    for name, complete in (("step_9999999", True), ("step_10000000", True),
                           ("step_10000005", False),  # no meta.json: not renamed by us
                           ("step_10000009.tmp", True), ("step_0000001.deleting", True),
                           ("step_10000010.deleting", True)):
        (ckpts / name).mkdir(parents=True)
        if complete:
            (ckpts / name / "meta.json").write_text("{}")
    rc, log, out = run_batch(tmp_path, "unfinished-save-then-fail")
    assert (ckpts / "step_0000009.tmp").is_dir()  # the fake's own unfinished save
    assert f"checkpoint: {ckpts / 'step_10000000'})" in out, out
    assert rc == 1 and not (log / "requeued").exists()  # no new complete checkpoint


@pytest.mark.parametrize("env, gloo", [
    ({}, None),                                            # neither: gloo's default
    ({"NCCL_SOCKET_IFNAME": "lo"}, "lo"),                  # the same interface
    ({"NCCL_SOCKET_IFNAME": "=lo"}, "lo"),                 # NCCL's exact match
    ({"NCCL_SOCKET_IFNAME": "l"}, "lo"),                   # a prefix: this node's match
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, None),          # an exclusion: gloo's default
    ({"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "eth7"}, "eth7"),  # its own wins
])
def test_gloo_gets_nccls_interface(tmp_path, env, gloo):
    rc, log, out = run_batch(tmp_path, "exit0", env_extra=env)
    assert rc == 0, out
    seen = dict(line.split("=", 1) for line in (log / "srun.env").read_text().splitlines()
                if "=" in line)
    assert seen.get("GLOO_SOCKET_IFNAME") == gloo
    if gloo:
        assert f"gloo on {gloo}" in out


@pytest.mark.parametrize("overrides, cpus_line, srun_cpus", [
    (["+recipe=gpt3-1.3b", "parallel.dp=8"], "#SBATCH --exclusive",  # a whole node
     "${SLURM_CPUS_ON_NODE:-1}"),
    (["+recipe=gpt3-1.3b", "parallel.dp=8", "cluster.cpus_per_task=32"],
     "#SBATCH --cpus-per-task=32", "32"),
    (["+recipe=gpt3-125m"], None, "${SLURM_CPUS_ON_NODE:-1}"),  # 1 GPU: a share of a node
])
def test_cpus_for_torchrun_from_the_cluster_config(overrides, cpus_line, srun_cpus):
    cfg = compose_config(overrides)
    lines = slurm.render(cfg, slurm.allocation(cfg), Path("/runs/x"), [],
                          Path("/work")).splitlines()
    cpu_lines = [line for line in lines if line.startswith(("#SBATCH --cpus", "#SBATCH --excl"))]
    assert cpu_lines == ([cpus_line] if cpus_line else [])
    assert f"CPUS_PER_TASK={srun_cpus}" in lines


# -- preparation jobs before training, with a stand-in for sbatch ---------------------------

FAKE_SBATCH = """#!/bin/bash
# stand-in for sbatch --parsable: record the arguments, print the next job id
n=$(( $(cat "$FAKE_LOG/n" 2>/dev/null || echo 100) + 1 )); echo "$n" > "$FAKE_LOG/n"
echo "$@" >> "$FAKE_LOG/sbatch.calls"
if [[ $n == "${FAKE_FAIL_AT:-}" ]]; then echo "sbatch: error: refused" >&2; exit 1; fi
echo "$n"
"""
FAKE_SCANCEL = """#!/bin/bash
echo "$@" >> "$FAKE_LOG/scancel.calls"
"""


def launch_with_fake_sbatch(tmp_path, monkeypatch, capsys, *args: str, fail_at: int = 0,
                            cwd: Path | None = None) -> tuple[int, list[list[str]], str]:
    """tools/launch.py's main in this process (in ``cwd``, default tmp_path) against
    stand-ins for sbatch and scancel: (exit code, each sbatch call's arguments, stdout)."""
    from hydra.core.hydra_config import HydraConfig

    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(parents=True)
    log.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_FAIL_AT", str(fail_at or ""))
    for var in CONTAINER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(cwd or tmp_path)
    try:
        rc = launch.main([*args, f"runs_dir={tmp_path / 'runs'}", "run_name=r"])
    finally:
        HydraConfig.instance().cfg = None
    calls = (log / "sbatch.calls").read_text().splitlines() if (log / "sbatch.calls").exists() \
        else []
    return rc, [c.split() for c in calls], capsys.readouterr().out


def test_unprepared_data_is_prepared_by_jobs_the_training_job_waits_for(tmp_path, monkeypatch,
                                                                        capsys):
    rc, calls, out = launch_with_fake_sbatch(
        tmp_path, monkeypatch, capsys, "+recipe=tiny-zero3", "cluster=local",
        f"data.root={tmp_path / 'data'}", "cluster.prepare_tasks=3")
    assert rc == 0, out
    run = tmp_path / "runs" / "r"
    prep, train = str(run / "prepare.sbatch"), str(run / "train.sbatch")
    plan, encode, merge, training = calls
    assert plan[0] == "--parsable" and not any(a.startswith("--dependency") for a in plan)
    assert plan[-2:] == [prep, "plan"]
    assert encode[1:3] == ["--dependency=afterok:101", "--kill-on-invalid-dep=yes"]
    assert "--array=0-2" in encode and encode[-2:] == [prep, "encode"]
    assert merge[1:3] == ["--dependency=afterok:102", "--kill-on-invalid-dep=yes"]
    assert merge[-2:] == [prep, "merge"]
    assert training == ["--parsable", "--dependency=afterok:103", "--kill-on-invalid-dep=yes",
                        train]
    assert "preparation jobs plan 101, encode 102 (array of 3), merge 103" in out
    assert "submitted job 104: r: 1 node(s) x 2 CPU processes" in out
    script = (run / "prepare.sbatch").read_text()
    lines = script.splitlines()
    assert "PREPARE_ARGS=(+recipe=tiny-zero3 cluster=local " \
           f"data.root={tmp_path / 'data'} cluster.prepare_tasks=3 runs_dir={tmp_path / 'runs'} " \
           "run_name=r)" in lines
    assert {"#SBATCH --cpus-per-task=1", "#SBATCH --partition=local",
            f"#SBATCH --chdir={tmp_path}", "#SBATCH --time=00:30:00"} <= set(lines)
    assert f"PREPARE_PY={REPO / 'tools' / 'prepare_data.py'}" in lines
    subprocess.run(["bash", "-n", str(run / "prepare.sbatch")], check=True)


def test_prepared_data_submits_training_alone(tmp_path, monkeypatch, capsys, prepared,
                                              work_dir):
    from helpers import CORPUS_FILES, DATA_NAME, TOKENIZER_VOCAB

    data = ["model.vocab_size=300", "data.source=text", f"data.name={DATA_NAME}",
            f"data.data_files=[{','.join(CORPUS_FILES)}]",
            f"data.tokenizer_vocab_size={TOKENIZER_VOCAB}", "data.validation_fraction=0.1",
            "data.num_proc=1", f"data.root={prepared.parent}"]
    monkeypatch.chdir(work_dir)  # the corpus files are relative to it
    assert slurm.data_prepared(compose_config(["+recipe=tiny-zero3", *data]))
    assert not slurm.data_prepared(compose_config(["+recipe=tiny-zero3", *data,
                                                    "data.tokenizer_vocab_size=301"]))
    rc, calls, out = launch_with_fake_sbatch(tmp_path, monkeypatch, capsys, "+recipe=tiny-zero3",
                                             "cluster=local", *data, cwd=work_dir)
    assert rc == 0 and calls == [["--parsable", str(tmp_path / "runs" / "r" / "train.sbatch")]]
    assert "preparation" not in out and not (tmp_path / "runs" / "r" / "prepare.sbatch").exists()


def test_no_prepare_and_a_refused_submission(tmp_path, monkeypatch, capsys):
    unprepared = ("+recipe=tiny-zero3", "cluster=local", f"data.root={tmp_path / 'data'}")
    rc, calls, out = launch_with_fake_sbatch(tmp_path / "a", monkeypatch, capsys, *unprepared,
                                             "--no-prepare")
    assert rc == 0 and len(calls) == 1 and calls[0][-1].endswith("train.sbatch")
    # the merge job refused: the jobs already queued are cancelled, training is not submitted
    rc, calls, out = launch_with_fake_sbatch(tmp_path / "b", monkeypatch, capsys, *unprepared,
                                             fail_at=103)
    assert rc == 1 and len(calls) == 3 and "submitted job" not in out
    assert (tmp_path / "b" / "log" / "scancel.calls").read_text().split() == ["101", "102"]


def test_dry_run_prints_the_preparation_chain(tmp_path, monkeypatch, capsys):
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.chdir(tmp_path)
    for var in CONTAINER_VARS:
        monkeypatch.delenv(var, raising=False)
    try:
        assert launch.main(["+recipe=tiny-zero3", "cluster=local", "--dry-run"]) == 0
    finally:
        HydraConfig.instance().cfg = None
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "prepare_data.py" not in out  # the job script
    run = tmp_path / "runs" / "tiny-zero3"
    assert "data/stdlib is not prepared: preparation jobs first, then training" in err
    assert "encode=$(sbatch --parsable --dependency=afterok:$plan --kill-on-invalid-dep=yes " \
           "--job-name=prep-encode-tiny-zero3 --array=0-1 " in err
    assert f"sbatch --parsable --dependency=afterok:$merge --kill-on-invalid-dep=yes " \
           f"{run / 'train.sbatch'}" in err
    assert f"# ---- {run / 'prepare.sbatch'} ----\n#!/bin/bash" in err
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


@pytest.mark.parametrize("elastic", [True, False])
def test_batch_script_goes_on_without_a_lost_node(tmp_path, elastic):
    """The ranks name node2 as lost: an elastic job (parallel.dp=null) gives node2 back and
    runs torchrun again on node1 alone, sharing the old step's CPUs; a fixed layout says why
    it cannot, and no new checkpoint means no requeue."""
    rc, log, out = run_batch(tmp_path, "lose-node2", env_extra={"ELASTIC": str(int(elastic)),
                                                                "LOST_GRACE": "0"})
    if elastic:
        assert rc == 0 and "lost node(s) node2 (training exited with 1); continuing on [node1]" \
            in out, out
        assert (log / "updated").read_text().split() == ["update", "JobId=42", "NodeList=node1"]
        again = (log / "srun.args2").read_text()
        assert again.startswith("--nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=node1 "
                                "--cpus-per-task=1 --overlap python -m torch.distributed.run "
                                "--nnodes=1 --nproc-per-node=4 ")
        assert "--rdzv-endpoint=node1:20043 --rdzv-id=42.1" in again  # a fresh rendezvous
    else:
        assert rc == 1 and "lost node(s) node2; not restarting on fewer nodes" in out, out
        assert not (log / "updated").exists() and not (log / "requeued").exists()


def test_an_elastic_layout_renders_an_elastic_job():
    proc = dry_run("+recipe=tiny-zero3", "cluster=local", "parallel.dp=null",
                   "cluster.procs_per_node=1", "--nodes", "2")
    assert proc.returncode == 0, proc.stderr
    assert "ELASTIC=1" in proc.stdout and "MAX_NODE_LOSSES=2" in proc.stdout
    assert "#SBATCH --no-kill" in proc.stdout and "#SBATCH --nodes=2" in proc.stdout
    fixed = dry_run("+recipe=tiny-zero3", "cluster=local")
    assert "ELASTIC=0" in fixed.stdout
