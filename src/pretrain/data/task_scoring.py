"""Ranked classification of multiple-choice tasks by log-likelihood: lm-eval-harness's
protocol, the one OLMo's in-loop evaluator and the leaderboards use.

For each choice the model scores ``log p(continuation | context)``, the sum of its tokens'
log-probabilities. Per document:

- ``acc``: the choice with the largest sum is right;
- ``acc_norm``: the choice with the largest sum divided by the choice's length in
  characters is right; lm-eval's ``process_results`` divides by ``len(choice)`` of the
  choice string without its target delimiter (the one leading space), which is the
  continuation less that space here;
- ``bpb``: bits per byte of the right continuation, ``-log p / ln 2 / utf8 bytes`` (the
  continuation as scored, leading space included, as OLMo's ``bpb``), averaged over the
  documents: tokenizer-independent, and smooth long before accuracy leaves chance.

Encoding follows lm-eval's ``_encode_pair``: trailing spaces of the context move to the
continuation; ``context + continuation`` is encoded whole and the continuation's tokens
are those past the context's own encoding; an empty context is the end-of-text token.
Inputs longer than ``seq_len`` lose tokens from the left (``[-(seq_len + 1):]``).

The model is an argument, ``logprobs(x, y) -> [B, T]`` (each position's log-probability
of ``y``, fp32; None on a rank that does not hold the output), so that one code path serves
the training loop under any layout and a plain model in a tool.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.data.tasks import Example, load_task

LogProbs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


@dataclass(frozen=True)
class Request:
    """One (context, continuation) pair as tokens: ``tokens`` the model reads and predicts
    (at most seq_len + 1), the last ``n_cont`` of which are the continuation's."""

    tokens: tuple[int, ...]
    n_cont: int


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str,
                eot_id: int) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: (context tokens, continuation tokens)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    if not context:
        return [eot_id], encode(continuation)
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx):]


def requests(examples: Sequence[Example], encode: Callable[[str], list[int]], seq_len: int,
             eot_id: int) -> list[Request]:
    """Every choice of every example, in order, as tokens cut to ``seq_len`` + 1."""
    out = []
    for ex in examples:
        for ctx, cont in zip(ex.contexts, ex.continuations, strict=True):
            c, k = encode_pair(encode, ctx, cont, eot_id)
            if not k:
                raise ValueError(f"document {ex.doc_id}: continuation {cont!r} encodes to no "
                                 "tokens")
            out.append(Request(tuple((c + k)[-(seq_len + 1):]), min(len(k), seq_len)))
    return out


def batches(reqs: Sequence[Request], batch_size: int) -> list[list[int]]:
    """Request indices in batches, longest first (lm-eval's order: similar lengths share a
    batch, so little of it is padding)."""
    order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i].tokens))
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def padded_tokens(reqs: Sequence[Request], batch_size: int, pad_multiple: int = 1) -> int:
    """Token positions the forwards over ``reqs`` compute, padding included: an interval's
    cost is about ``2 * params * this`` FLOPs (a training step: 6 x params x its tokens)."""
    return sum(len(rows) * math.ceil(max(len(reqs[i].tokens) - 1 for i in rows)
                                     / pad_multiple) * pad_multiple
               for rows in batches(reqs, batch_size))


def pack(reqs: Sequence[Request], rows: Sequence[int], pad_multiple: int = 1
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``rows``, right-padded with token 0 to the longest, rounded up
    to ``pad_multiple`` (sequence parallelism splits the length over TP ranks). Causal
    attention keeps the padding out of every real position."""
    length = max(len(reqs[i].tokens) - 1 for i in rows)
    length = math.ceil(length / pad_multiple) * pad_multiple
    x = torch.zeros(len(rows), length, dtype=torch.long)
    y = torch.zeros(len(rows), length, dtype=torch.long)
    for r, i in enumerate(rows):
        t = torch.tensor(reqs[i].tokens)
        x[r, : len(t) - 1], y[r, : len(t) - 1] = t[:-1], t[1:]
    return x, y


def loglikelihoods(reqs: Sequence[Request], logprobs: LogProbs, batch_size: int, *,
                   rank: int = 0, world: int = 1, pad_multiple: int = 1,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Each request's ``log p(continuation | context)`` (summed in fp64, kept as fp32, on the
    host: the precision an all-reduce over ranks carries unchanged), for the batches
    this rank computes: batch j goes to rank j % world; the other entries are 0, so the sum
    over ranks is the whole vector. Every rank runs the same number of forwards (FSDP needs
    every rank in every collective): a rank short of batches repeats one and discards it."""
    out = torch.zeros(len(reqs), dtype=torch.float32)
    plan = batches(reqs, batch_size)
    rounds = math.ceil(len(plan) / world)
    for k in range(rounds):
        j = k * world + rank
        rows = plan[j] if j < len(plan) else plan[0]
        x, y = pack(reqs, rows, pad_multiple)
        lp = logprobs(x.to(device), y.to(device))
        if lp is None or j >= len(plan):
            continue
        lp = lp.detach().double().cpu()
        for r, i in enumerate(rows):
            end = len(reqs[i].tokens) - 1
            out[i] = lp[r, end - reqs[i].n_cont: end].sum().float()
    return out


def choice_chars(continuation: str) -> int:
    """A choice's length as lm-eval's ``acc_norm`` counts it: characters of the choice
    string, i.e. the continuation without its one leading space (the target delimiter)."""
    return len(continuation[1:] if continuation.startswith(" ") else continuation)


def metrics(examples: Sequence[Example], lls: Sequence[float]) -> dict[str, float]:
    """acc, acc_norm and bpb (see the module's docstring) over ``examples``, from the
    log-likelihoods of their choices in order (as ``requests`` lists them)."""
    acc = norm = bpb = 0.0
    i = 0
    for ex in examples:
        ll = [float(v) for v in lls[i: i + len(ex.continuations)]]
        i += len(ex.continuations)
        normed = [v / max(1, choice_chars(c)) for v, c in zip(ll, ex.continuations, strict=True)]
        acc += float(_argmax(ll) == ex.label)
        norm += float(_argmax(normed) == ex.label)
        gold = ex.continuations[ex.label]
        bpb += -ll[ex.label] / math.log(2) / len(gold.encode("utf-8"))
    n = len(examples)
    return {"acc": acc / n, "acc_norm": norm / n, "bpb": bpb / n}


def _argmax(values: list[float]) -> int:
    """The first index of the largest value (numpy's argmax, which lm-eval uses)."""
    return max(range(len(values)), key=lambda j: (values[j], -j))


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

    def __init__(self, cfg, tokenizer_file: Path, seq_len: int):
        """``cfg``: the run's EvalConfig (tasks, max_examples, tasks_dir)."""
        encode, eot = text_encoder(tokenizer_file)
        self.examples: dict[str, list[Example]] = {}
        self.requests: dict[str, list[Request]] = {}
        for task in cfg.tasks:
            ex = load_task(task, cfg.max_examples, cfg.tasks_dir)
            self.examples[task] = ex
            self.requests[task] = requests(ex, encode, seq_len, eot)

    def describe(self) -> str:
        return ", ".join(f"{t} ({len(ex)} documents, {len(self.requests[t])} choices)"
                         for t, ex in self.examples.items())

    def tokens(self, batch_size: int, pad_multiple: int = 1) -> int:
        """Token positions one scoring of every task computes (padding included)."""
        return sum(padded_tokens(r, batch_size, pad_multiple)
                   for r in self.requests.values())
