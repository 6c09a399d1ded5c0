"""``eval.tasks`` in the plan (decision/tasks.py): the dry run states the tasks, their files
and documents, and what scoring costs, the hook's own count; a missing task stops the dry
run and the real run with the same line, before any data is prepared or weight built."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import REPO
from train_forks import train_py

from pretrain.config.schema import EvalConfig
from pretrain.data.task_scoring import TaskSet
from pretrain.data.tasks import TaskNotFound
from pretrain.decision.resolve import dry_run

TASKS_DIR = REPO / "tests" / "data" / "tasks"
TASKS = "eval.tasks=[hellaswag,arc_easy]"
SMALL = ["model=nano", "model.vocab_size=300", "model.seq_len=32", "model.n_head=2",
         "data.name=tinytext", "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
         "parallel.micro_batch_size=4", "budget=steps", "budget.steps=250",
         "train.eval_interval=50", "eval.task_interval=100", "eval.max_examples=5"]


def train(*overrides: str, cwd) -> subprocess.CompletedProcess:
    return train_py(*overrides, cwd=cwd, env={"OMP_NUM_THREADS": "1"})


def test_the_dry_run_states_the_tasks_and_their_cost(compose, prepared, capsys):
    cfg = compose([*SMALL, TASKS, f"eval.tasks_dir={TASKS_DIR}",
                   f"data.root={prepared.parent}", "data.auto_prepare=false"])
    plan = dry_run(cfg)
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["eval_tasks"] == plan["eval_tasks"]
    tasks = plan["eval_tasks"]
    assert [(t["task"], t["documents"], t["choices"]) for t in tasks["tasks"]] == [
        ("hellaswag", 5, 20), ("arc_easy", 5, 20)]
    assert tasks["tasks"][0]["file"] == str(TASKS_DIR / "hellaswag/rc_0shot/requests.jsonl")
    # step 0, 100, 200 and the last (250)
    assert tasks["every_steps"] == 100 and tasks["scorings"] == 4
    expected = TaskSet(EvalConfig(tasks=["hellaswag", "arc_easy"], max_examples=5,
                                  tasks_dir=str(TASKS_DIR)),
                       prepared / "tokenizer.json", 32).tokens(4)
    assert tasks["forward_tokens"] == expected
    assert tasks["training_steps_each"] == expected / (3 * 8 * 32)
    line = out.err.strip().splitlines()[-1]
    assert line.startswith("downstream tasks: hellaswag (5 documents, 20 choices, from ")
    assert f"scored 4 times (step 0, every 100 steps, the last): {expected:,} tokens" in line


def test_without_a_tokenizer_the_plan_says_when_the_cost_is_counted(compose, tmp_path):
    cfg = compose([*SMALL, TASKS, f"eval.tasks_dir={TASKS_DIR}", f"data.root={tmp_path}"])
    tasks = dry_run(cfg)["eval_tasks"]
    assert tasks["forward_tokens"] is None
    assert tasks["cost"] == f"counted once {tmp_path / 'tinytext' / 'tokenizer.json'} exists " \
        "(the data prepared)"


def test_a_missing_task_stops_the_dry_run_and_the_run_alike(compose, tmp_path):
    """The real run's one line (exit 2) is the dry run's error, word for word; the run
    stopped before preparing its data (auto_prepare would have written data/tinytext) or
    building anything."""
    common = [*SMALL, "eval.tasks=[hellaswag,piqa]", f"eval.tasks_dir={TASKS_DIR}",
              f"data.root={tmp_path / 'data'}", "checkpoint.enabled=false", "logging=quiet"]
    with pytest.raises(TaskNotFound) as dry:
        dry_run(compose(common))
    real = train(*common, cwd=tmp_path)
    assert real.returncode == 2, real.stderr
    (line,) = [ln for ln in real.stderr.splitlines() if ln.startswith("error: ")]
    assert line == f"error: {dry.value}"
    assert line.startswith("error: task 'piqa': no piqa/rc_0shot/requests.jsonl[.gz] in ")
    assert "tasks there: arc_easy:rc_0shot, hellaswag:rc_0shot" in line
    assert not (tmp_path / "data").exists()
