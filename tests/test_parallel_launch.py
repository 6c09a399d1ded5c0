"""Launching: tools/run_local.py -> torchrun -> train.py on 2 processes, end to end.

The data is prepared first, by its own process (torchrun alone refuses unprepared data),
both ranks compose the same run directory, and only rank 0 writes there: one plan, one
metrics line per step, one result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    CORPUS_FILES,
    MARKOV_DATA,
    REPO,
    VOCAB,
    launch_env,
    read_metrics,
    read_result,
)

RUN_LOCAL = str(REPO / "tools" / "run_local.py")


def run_local(*args: str, cwd=REPO, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, RUN_LOCAL, *args], cwd=cwd, capture_output=True,
                          text=True, check=check, env=launch_env(), timeout=600)


def print_run_local(capsys, *args: str) -> tuple[int, str, str]:
    """``tools/run_local.py --print ARGS`` in this process (it starts nothing with --print:
    no python start-up for a printed command); its status, stdout and stderr."""
    from pretrain.tools.run_local import main

    code = main(["--print", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_local_counts_the_processes_a_layout_needs(capsys):
    code, out, _ = print_run_local(capsys, "+recipe=nano-3d")
    assert code == 0
    assert "pretrain.launch.torchrun --standalone --nproc_per_node=8" in out  # torchrun
    assert out.strip().endswith("train.py +recipe=nano-3d")
    _, out, _ = print_run_local(capsys, "--nproc", "4", "+recipe=tiny", "parallel=zero3",
                                "parallel.dp=null", "parallel.micro_batch_size=2")
    assert "--nproc_per_node=4" in out


def test_run_local_needs_nproc_when_dp_is_left_to_the_world(capsys):
    code, _, err = print_run_local(capsys, "+recipe=tiny", "parallel=zero3",
                                   "parallel.dp=null")
    assert code != 0 and "pass --nproc N" in err


@pytest.mark.slow
def test_two_process_run_writes_once_from_rank_0(work_dir, tmp_path):
    files = ",".join(CORPUS_FILES)
    args = (
        "+recipe=tiny-zero3", "model=nano", "model.vocab_size=300", "data.source=text",
        "data.name=launch", f"data.data_files=[{files}]", "data.tokenizer_vocab_size=300",
        "data.num_proc=1", f"data.root={tmp_path / 'data'}", f"runs_dir={tmp_path / 'runs'}",
        "budget=steps", "budget.steps=3", "train.global_batch_size=8",
        "parallel.micro_batch_size=2", "train.eval_batches=2", "train.eval_interval=2",
        "train.sample_tokens=5", "logging=quiet", "logging.log_interval=1", "train.device=cpu",
    )
    # torchrun straight onto unprepared data: every rank stops before its process group,
    # naming the preparation command, and nothing is tokenised.
    t0 = time.monotonic()
    bare = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "train.py"), *args], cwd=work_dir, capture_output=True, text=True,
        env=launch_env(), timeout=120)
    assert bare.returncode != 0 and time.monotonic() - t0 < 60
    assert "tools/prepare_data.py" in bare.stdout + bare.stderr
    assert not (tmp_path / "data" / "launch").exists()
    # run_local prepares first (its own process), then trains
    proc = run_local(*args, cwd=work_dir, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "run_local: preparing data.name=launch first" in proc.stderr
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1  # both ranks composed the same run directory
    run = runs[0]
    assert {"metrics.jsonl", "plan.json", "result.json", "train.log", ".hydra"} <= {
        p.name for p in run.iterdir()}
    plan = json.loads((run / "plan.json").read_text())
    assert plan["layout"]["world_size"] == 2 and plan["layout"]["dp_mode"] == "zero3"
    rows = read_metrics(run)
    assert [m["step"] for m in rows if "loss" in m] == [1, 2, 3]  # rank 0 only
    assert [m["step"] for m in rows if "val_loss" in m] == [0, 2, 3]
    done = read_result(run)
    assert done["steps"] == 3 and done["sample"]  # generation ran on the sharded model
    log = (run / "train.log").read_text()
    assert log.count("plan: ") == 1 and log.count("step 3/3 | loss") == 1
    assert (proc.stdout + proc.stderr).count("step 3/3 | loss") == 1  # one voice on screen
    assert (tmp_path / "data" / "launch" / "index.json").exists()  # prepared once, first
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["launch"]  # no leftovers


def _process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process, from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def _descendants(pid: int) -> set[int]:
    table, found, todo = _process_table(), set(), [pid]
    while todo:
        parent = todo.pop()
        children = {p for p, (pp, _) in table.items() if pp == parent}
        found |= children
        todo.extend(children)
    return found


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has finished: it waits to be reaped)."""
    table = _process_table()
    return {p for p in pids if p in table and table[p][1] != "Z"}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_kill_9_of_the_launcher_leaves_no_rank_alive(tmp_path, markov_root):
    """torchrun starts each rank in a session of its own: a launcher killed with SIGKILL
    (which it cannot pass on) must still take torchrun and both ranks with it, within
    10 s. The ranks are looked for as they train (rank 0 has logged a step)."""
    args = [
        "+recipe=tiny-zero3",
        "model=nano",
        f"model.vocab_size={VOCAB}",
        *MARKOV_DATA,
        f"data.root={markov_root}",
        "model.seq_len=32",
        "budget=steps",
        "budget.steps=100000",
        "data.max_epochs=1e6",
        "train.eval_interval=100000",
        "train.eval_batches=1",
        "logging=quiet",
        "logging.log_interval=1",
        f"runs_dir={tmp_path}",
        "run_name=orphans",
        "checkpoint.enabled=false",
        "train.compile=false",
    ]
    log = (tmp_path / "launcher.log").open("w")
    launcher = subprocess.Popen([sys.executable, RUN_LOCAL, *args], cwd=tmp_path,
                                stdout=log, stderr=subprocess.STDOUT, env=launch_env())
    ranks: set[int] = set()
    try:
        metrics = tmp_path / "orphans" / "metrics.jsonl"
        t0 = time.monotonic()
        while not (metrics.exists() and '"loss"' in metrics.read_text()):
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-4000:]
            assert time.monotonic() - t0 < 300, "no step logged in 300 s"
            time.sleep(0.2)
        ranks = _descendants(launcher.pid)  # torchrun, its 2 ranks (and their helpers)
        assert len(ranks) >= 3, ranks
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        t0 = time.monotonic()
        while _alive(ranks) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not _alive(ranks), f"alive 10 s after the launcher was killed: {_alive(ranks)}"
    finally:
        for pid in _alive(ranks):  # what a failure left behind, by pid
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        log.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_a_rank_whose_agent_died_before_it_was_tied_kills_itself():
    """Between torchrun's fork and the rank's prctl the agent can die: the rank is adopted
    then, and its new parent's parent is not the launcher, so it takes SIGKILL itself."""
    code = ("from pretrain.launch.lifeline import tie_rank_to_agent; "
            "print(tie_rank_to_agent(), flush=True)")

    def rank(launcher: int) -> subprocess.CompletedProcess:
        env = launch_env(TORCHELASTIC_RUN_ID="test", PRETRAIN_LAUNCHER_PID=str(launcher))
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60)

    # its parent (this process, as the agent) was started by our own parent: tied, alive
    tied = rank(os.getppid())
    assert tied.returncode == 0 and tied.stdout.strip() == "True", tied.stderr
    adopted = rank(os.getpid())  # as if this process had adopted it: not the launcher's
    assert adopted.returncode == -signal.SIGKILL and adopted.stdout == ""
