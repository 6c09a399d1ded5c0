"""Launching: tools/run_local.py -> torchrun -> train.py on 2 processes, end to end.

The data is prepared first, by its own process (torchrun alone refuses unprepared data),
both ranks compose the same run directory, and only rank 0 writes there: one plan, one
metrics line per step, one result.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from helpers import CORPUS_FILES, REPO, launch_env, read_metrics, read_result

RUN_LOCAL = str(REPO / "tools" / "run_local.py")


def run_local(*args: str, cwd=REPO, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, RUN_LOCAL, *args], cwd=cwd, capture_output=True,
                          text=True, check=check, env=launch_env(), timeout=600)


def test_run_local_counts_the_processes_a_layout_needs():
    out = run_local("--print", "+recipe=nano-3d").stdout
    assert "torch.distributed.run --standalone --nproc_per_node=8" in out
    assert out.strip().endswith("train.py +recipe=nano-3d")
    out = run_local("--print", "--nproc", "4", "+recipe=tiny", "parallel=zero3",
                    "parallel.dp=null").stdout
    assert "--nproc_per_node=4" in out


def test_run_local_needs_nproc_when_dp_is_left_to_the_world():
    proc = run_local("--print", "+recipe=tiny", "parallel=zero3", "parallel.dp=null",
                     check=False)
    assert proc.returncode != 0 and "pass --nproc N" in proc.stderr


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
