"""A run's downstream tasks (``eval.tasks``) in its plan: which, where their documents come
from, and what scoring them costs, decided before any weight or batch exists.

``describe_tasks`` reads every task's request file the way the run's hook will
(data/tasks.load_task: the same documents, the same error), so a missing task stops the
real run and the dry run alike, in the plan (decision/resolve.resolve_plan), with one line
naming where it looked and the tasks found there. The cost is the hook's own count
(data/task_scoring.TaskSet.tokens: token positions forward, padding included) when the
run's tokenizer exists; before the data is prepared there is no tokenizer, and the plan
says so instead of guessing.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.budget.compute import Budget
from pretrain.config.schema import Config
from pretrain.data.prepare import data_dir
from pretrain.data.task_scoring import TaskSet
from pretrain.data.tasks import describe_source, load_task, request_source
from pretrain.data.weights import mixture_sources


def run_tokenizer(cfg: Config) -> Path:
    """The tokenizer.json the run will encode with (its data's; a mixture's first
    source's, which every source shares)."""
    if cfg.data.mixture:
        return mixture_sources(cfg.data)[0][1] / "tokenizer.json"
    return data_dir(cfg.data) / "tokenizer.json"


def scoring_steps(steps: int, interval: int) -> int:
    """How many times a run of ``steps`` scores its tasks: at step 0, every ``interval``
    steps, and at the last step (train/services/tasks.TaskEvaluation.due)."""
    return 1 + steps // interval + (1 if steps % interval else 0)


def describe_tasks(cfg: Config, budget: Budget) -> dict:
    """The plan's ``eval_tasks`` (empty without ``eval.tasks``): each task's request file
    and documents, how often they are scored, and the forward tokens and training-step
    FLOPs each scoring costs. TaskNotFound when a task's data is missing."""
    e = cfg.eval
    if not e.tasks:
        return {}
    entries = [{"task": t, "file": str(request_source(t, e.tasks_dir)),
                "documents": len(ex), "choices": sum(len(x.continuations) for x in ex)}
               for t, ex in ((t, load_task(t, e.max_examples, e.tasks_dir)) for t in e.tasks)]
    interval = e.task_interval or cfg.train.eval_interval
    out = {"from": describe_source(e.tasks_dir), "tasks": entries, "every_steps": interval,
           "scorings": scoring_steps(budget.steps, interval)}
    tokenizer = run_tokenizer(cfg)
    if not tokenizer.is_file():
        return {**out, "forward_tokens": None,
                "cost": f"counted once {tokenizer} exists (the data prepared)"}
    batch = e.batch_size or cfg.parallel.micro_batch_size
    tokens = TaskSet(e, tokenizer, cfg.model.seq_len).tokens(batch, cfg.parallel.tp)
    steps = tokens / (3 * budget.global_batch_tokens)  # forward 2N a token, training 6N
    return {**out, "forward_tokens": tokens, "training_steps_each": steps,
            "share_of_training": steps * out["scorings"] / budget.steps}


def describe_line(entry: dict) -> str:
    """The plan's ``eval_tasks`` in one line, for the dry run."""
    tasks = ", ".join(f"{t['task']} ({t['documents']} documents, {t['choices']} choices, "
                      f"from {t['file']})" for t in entry["tasks"])
    when = (f"scored {entry['scorings']} times (step 0, every {entry['every_steps']} steps, "
            "the last)")
    if entry["forward_tokens"] is None:
        return f"downstream tasks: {tasks}; {when}; the cost is {entry['cost']}"
    return (f"downstream tasks: {tasks}; {when}: {entry['forward_tokens']:,} tokens forward "
            f"each time, the FLOPs of {entry['training_steps_each']:.2f} training steps; "
            f"{100 * entry['share_of_training']:.1f}% of the run's training FLOPs in all")
