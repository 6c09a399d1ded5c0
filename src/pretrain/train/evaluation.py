"""Validation: the loss of the model as it trains, of each source in nats per token and bits
per byte, and the run's ``val_loss`` as their ``mixture_mean`` (``Validation``, one path for
a single corpus and a mixture alike; the trainer owns it).

The validation loss is the mean over the first ``eval_batch_count()`` micro batches of the
validation split, each counted once, spread over the DP ranks: the same batches, so the
same mean (up to reduction order), for every layout that evaluates the same number. How
many batches one evaluation call computes is the step strategy's (``eval_chunk``,
``eval_round``: whole pipeline steps under pipeline parallelism); the evaluator never asks
which strategy runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.data.loader import TokenWindows
from pretrain.data.prepare import load_index

log = logging.getLogger("pretrain")


class Evaluator:
    """The validation loss over ``eval_batches`` micro batches of ``micro_batch_size``
    sequences of ``val_data`` (a data.loader.TokenWindows), computed by ``module`` (a
    TrainModule: ``eval_losses``, ``sum_over_dp``, ``eval_chunk``, ``eval_round``) on DP
    rank ``dp_rank`` of ``dp``."""

    def __init__(self, val_data, module, *, eval_batches: int, micro_batch_size: int,
                 dp: int, dp_rank: int, device: torch.device):
        self.val_data, self.module = val_data, module
        self.asked, self.mbs = eval_batches, micro_batch_size
        self.dp, self.dp_rank, self.device = dp, dp_rank, device

    def batch_count(self) -> int:
        """How many validation batches (of micro_batch_size sequences) an evaluation
        averages over: ``train.eval_batches``, rounded up to whole pipeline steps under PP
        (see _wanted), capped at the distinct batches the split holds."""
        return min(self._wanted(), self._available())

    def _wanted(self) -> int:
        """``train.eval_batches``, rounded up to the batches one evaluation call computes
        over every DP rank anyway (the step strategy's ``eval_round``: 1 under
        accumulation; dp x microbatches under pipeline parallelism, whose every computed
        microbatch is then a distinct batch that counts)."""
        per_step = self.module.eval_round
        return math.ceil(self.asked / per_step) * per_step

    def _available(self) -> int:
        """Distinct validation batches in the split (at least one, which then wraps)."""
        return max(1, self.val_data.n_windows // self.mbs)

    def describe(self) -> None:
        """Say once, before the first evaluation, when it averages over another number of
        batches than ``train.eval_batches`` asks, and why."""
        wanted, count = self._wanted(), self.batch_count()
        rounded = f", {wanted} in whole pipeline steps" if wanted != self.asked else ""
        if count < wanted:
            log.warning("the validation split holds %d windows of %d tokens, %d distinct "
                        "batch(es) of %d sequences: each evaluation averages those %d "
                        "(train.eval_batches=%d%s)", self.val_data.n_windows,
                        self.val_data.seq_len + 1, count, self.mbs, count, self.asked,
                        rounded)
        elif count != self.asked:
            log.info("evaluation: %d validation batches (train.eval_batches=%d rounded up to "
                     "whole pipeline steps of dp x microbatches = %d batches, which the "
                     "pipeline computes anyway)", count, self.asked, self.module.eval_round)

    def assignment(self) -> list[tuple[int, float]]:
        """(validation batch, weight) pairs this DP rank evaluates: batch i of
        batch_count() goes to rank i % dp; ranks pad with weight-0 repeats so all run
        the same number of forwards (FSDP and pipelines need every rank in every
        collective), in whole evaluation calls of the step strategy (``eval_chunk``: whole
        pipeline steps under PP). Under PP the count is whole pipeline steps already, so
        there is no padding unless the split is smaller."""
        n, dp, chunk = self.batch_count(), self.dp, self.module.eval_chunk
        rounds = math.ceil(math.ceil(n / dp) / chunk) * chunk
        mine = [k * dp + self.dp_rank for k in range(rounds)]
        return [(i, 1.0) if i < n else (0, 0.0) for i in mine]

    def evaluate(self) -> float:
        """The mean validation loss, the same on every rank (every rank calls it)."""
        work, chunk = self.assignment(), self.module.eval_chunk
        total = torch.zeros((), device=self.device)
        for j in range(0, len(work), chunk):
            part = work[j: j + chunk]
            losses = self.module.eval_losses(*self._batch([i for i, _ in part]))
            if losses is None:  # a rank that does not hold the loss (pipeline)
                continue
            for (_, weight), loss in zip(part, losses, strict=True):
                total += weight * loss.float()
        return (self.module.sum_over_dp(total) / self.batch_count()).item()

    def _batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batches ``indices`` (of micro_batch_size sequences), concatenated."""
        batches = [self.val_data.batch(i * self.mbs, self.mbs) for i in indices]
        return (
            to_device(torch.cat([b[0] for b in batches]), self.device),
            to_device(torch.cat([b[1] for b in batches]), self.device),
        )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device`` without making the host wait: a pageable copy to a GPU
    blocks until every kernel queued before it has run; a pinned one is queued like a
    kernel (and the pinned block is reused only once the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# -- validation per source, in loss and bits per byte -------------------------------------------


def bits_per_byte(loss: float, tokens: int, nbytes: int) -> float:
    """Bits per byte of a mean loss of ``loss`` nats per token over text that ``tokens``
    tokens of ``nbytes`` UTF-8 bytes stand for: nats per byte over ln 2."""
    return loss * (tokens / nbytes) / math.log(2)


def mixture_mean(values: dict[str, float | None], weights: dict[str, float]) -> float | None:
    """THE definition of a run's ``val_loss`` (``first_val_loss``, ``final_val_loss``) and
    ``final_val_bpb``: the mean of the sources' ``values`` weighted by ``weights``, the
    run's ``data.mixture`` weights (``validation_sources``: fixed for the whole run, the
    stable phase's, whatever ``data.stages`` or ``data.cooldown_weights`` train on later),
    over the sources of positive weight (weight 0: validation only). Fixed weights make
    every evaluation point, and runs or branches that differ in their later stages, a
    measure of the same target. One source (a single corpus): its value, bit for bit.
    None when a weighted source has no value."""
    names = [n for n, w in weights.items() if w > 0]
    if not names or any(values.get(n) is None for n in names):
        return None
    return math.fsum(weights[n] * values[n] for n in names) / math.fsum(weights[n] for n in names)


@dataclass(frozen=True)
class ValidationSource:
    """One validation set: a source's name, its prepared corpus (a ``data.root/<name>``
    directory, its ``validation`` split evaluated) and its share of the training tokens."""

    name: str
    path: Path
    weight: float = 1.0


def validation_sources(data_cfg) -> list[ValidationSource]:
    """The sources a run validates on: every entry of ``data.mixture`` ({name, weight},
    each prepared under ``data.root``; weight 0 = validation only), else the one corpus
    ``data.name``."""
    mixture = getattr(data_cfg, "mixture", None)
    if mixture:
        return [ValidationSource(s.name, Path(data_cfg.root) / s.name, float(s.weight))
                for s in mixture]
    return [ValidationSource(data_cfg.name, Path(data_cfg.root) / data_cfg.name)]


class Validation:
    """The run's validation, one path for every source (a single corpus is a mixture of
    one): each source's loss at every evaluation point, in nats per token and in bits per
    byte (``bits_per_byte`` with the split's tokens and bytes as preparation counted them),
    reported as ``val_loss/<name>`` and ``val_bpb/<name>`` (log line, metrics.jsonl, wandb)
    and in result.json as ``val/<name>: {loss, bpb, weight}`` and ``final_val_bpb``; the
    run's ``val_loss`` is their ``mixture_mean``."""

    def __init__(self, sets: dict[str, TokenWindows], weights: dict[str, float],
                 make_evaluator: Callable[[TokenWindows], Evaluator]):
        self.sets, self.weights = sets, weights
        self.evaluators = {n: make_evaluator(w) for n, w in sets.items()}
        self.counts = {n: w.text_bytes() for n, w in sets.items()}
        self.loss: dict[str, float | None] = {}
        self.bpb: dict[str, float | None] = {}

    def describe(self) -> None:
        """Once, on rank 0, before the first evaluation: the sources validated on, which
        have no byte counts, and each evaluator's batch count when it is not the one asked."""
        log.info("validation per source: %s", ", ".join(
            f"{n} (weight {self.weights[n]:g}, {w.n_windows} windows)"
            for n, w in self.sets.items()))
        for n, counts in self.counts.items():
            if counts is None:
                log.warning(unavailable_note(n, self.sets[n].path))
        for ev in self.evaluators.values():
            ev.describe()

    def evaluate(self) -> dict[str, float | None]:
        """Every source's loss (every rank calls it): the evaluation point's metrics,
        ``val_loss`` (the ``mixture_mean``) first."""
        metrics: dict[str, float | None] = {}
        for n, ev in self.evaluators.items():
            loss = self.loss[n] = ev.evaluate()
            counts = self.counts[n]
            self.bpb[n] = None if counts is None else bits_per_byte(loss, *counts)
            metrics[f"val_loss/{n}"] = loss
            if self.bpb[n] is not None:
                metrics[f"val_bpb/{n}"] = self.bpb[n]
        return {"val_loss": mixture_mean(self.loss, self.weights), **metrics}

    def batch_count(self) -> int | None:
        """Validation batches an evaluation averages over, when every source uses the
        same number (each split caps its own)."""
        counts = {ev.batch_count() for ev in self.evaluators.values()}
        return counts.pop() if len(counts) == 1 else None

    def result(self) -> dict:
        """result.json's validation keys (the last evaluation's)."""
        out: dict = {}
        for n in self.sets:
            entry = {"loss": self.loss.get(n), "bpb": self.bpb.get(n), "weight": self.weights[n]}
            if self.counts[n] is None:
                entry["bpb_unavailable"] = unavailable_note(n, self.sets[n].path)
            out[f"val/{n}"] = entry
        out["final_val_bpb"] = mixture_mean(self.bpb, self.weights)
        return out


def unavailable_note(name: str, path: Path) -> str:
    return (f"bits per byte unavailable for '{name}': {path} was prepared before preparation "
            f"counted the bytes of its text; move {path} aside and prepare it again "
            f"(`python tools/prepare_data.py data=...`) to get them")


def open_validation_sets(sources: list[ValidationSource], seq_len: int,
                         own: TokenWindows | None = None
                         ) -> tuple[dict[str, TokenWindows], dict[str, float]]:
    """(windows, weight) of each source that has a validation split; ``own``: windows the
    run opened already (its single corpus's), used for the source whose split they are."""
    sets, weights = {}, {}
    own_path = getattr(own, "path", None)
    for src in sources:
        same = own_path is not None and Path(src.path).resolve() == Path(own_path).resolve()
        windows = own if same else open_validation(src.path, seq_len)
        if windows is not None:
            sets[src.name], weights[src.name] = windows, src.weight
    return sets, weights


def validation(cfg, module, *, dp_rank: int, device: torch.device,
               own: TokenWindows | None = None,
               sources: list[ValidationSource] | None = None) -> Validation | None:
    """The run's validation: ``sources`` (by default its config's, ``validation_sources``)
    evaluated by ``module`` (a TrainModule) on this DP rank; None when none has a
    validation split. The one place an ``Evaluator`` is built for a run."""
    if sources is None:
        sources = validation_sources(cfg.data)
    sets, weights = open_validation_sets(sources, cfg.model.seq_len, own)
    if not sets:
        return None
    layout = module.layout

    def make(windows: TokenWindows) -> Evaluator:
        return Evaluator(windows, module, eval_batches=cfg.train.eval_batches,
                         micro_batch_size=layout.micro_batch_size, dp=layout.dp,
                         dp_rank=dp_rank, device=device)

    return Validation(sets, weights, make)


def open_validation(path: Path, seq_len: int) -> TokenWindows | None:
    """The validation windows of the corpus at ``path``; None when it has no such split."""
    if "validation" not in load_index(Path(path))["splits"]:
        return None
    return TokenWindows(path, "validation", seq_len, shuffle=False)
