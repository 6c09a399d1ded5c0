"""Downstream tasks while the run trains: HellaSwag, ARC, PIQA and friends scored by the
model's log-likelihood of each choice (data/task_scoring.py: lm-eval's ranked
classification), from task data on this machine (data/tasks.py), at evaluation points.

The hook (services/tasks.py) adds ``task/<name>/acc``, ``task/<name>/acc_norm`` and ``task/<name>/bpb`` to the
evaluation's metrics (log line, metrics.jsonl, wandb) and the last values to result.json
(flat numbers, so a sweep's fit can read a task's bpb as it reads val_loss).

The forward is the train module's (``token_logprobs``: the model as the validation loss
runs it, in the run's compute dtype). Batches are spread over the DP ranks and their
log-likelihoods summed over them (``sum_over_dp``), so every layout that holds whole
models or TP shards gives the numbers one process gives; pipeline layouts are refused by
the config check (decision/checks.py) until the schedule returns per-token losses.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pretrain.config.schema import EvalConfig
from pretrain.data import task_scoring
from pretrain.data.tasks import Example, load_task

log = logging.getLogger("pretrain")


def text_encoder(tokenizer_file: Path):
    """(encode: text -> token ids without special tokens, the end-of-text id) of the run's
    tokenizer.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    eot = tok.token_to_id("<|endoftext|>")
    index = tokenizer_file.parent / "index.json"
    if eot is None and index.is_file():  # a hub tokenizer: the data's declared eos id
        eot = json.loads(index.read_text())["eos_id"]
    if eot is None:
        raise ValueError(f"{tokenizer_file} has no <|endoftext|> token and no index.json "
                         "beside it names an eos id: an empty context has no start token")
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), int(eot)


class TaskSet:
    """The tasks' examples and their encoded requests, loaded once."""

    def __init__(self, cfg: EvalConfig, tokenizer_file: Path, seq_len: int):
        encode, eot = text_encoder(tokenizer_file)
        self.examples: dict[str, list[Example]] = {}
        self.requests: dict[str, list[task_scoring.Request]] = {}
        for task in cfg.tasks:
            ex = load_task(task, cfg.max_examples, cfg.tasks_dir)
            self.examples[task] = ex
            self.requests[task] = task_scoring.requests(ex, encode, seq_len, eot)

    def describe(self) -> str:
        return ", ".join(f"{t} ({len(ex)} documents, {len(self.requests[t])} choices)"
                         for t, ex in self.examples.items())

    def tokens(self, batch_size: int, pad_multiple: int = 1) -> int:
        """Token positions one scoring of every task computes (padding included)."""
        return sum(task_scoring.padded_tokens(r, batch_size, pad_multiple)
                   for r in self.requests.values())


def score(tasks: TaskSet, logprobs, batch_size: int, *, rank: int = 0, world: int = 1,
          pad_multiple: int = 1, device: torch.device | str = "cpu",
          reduce=lambda t: t) -> dict[str, float]:
    """Every task's metrics as flat ``task/<name>/<metric>`` keys; ``reduce`` sums a
    rank's log-likelihoods over the ranks that split the batches."""
    out: dict[str, float] = {}
    for task, reqs in tasks.requests.items():
        lls = task_scoring.loglikelihoods(reqs, logprobs, batch_size, rank=rank, world=world,
                                          pad_multiple=pad_multiple, device=device)
        lls = reduce(lls.to(device)).double().cpu()
        for key, value in task_scoring.metrics(tasks.examples[task], lls.tolist()).items():
            out[f"task/{task}/{key}"] = value
    return out
