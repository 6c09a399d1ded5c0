"""Evaluation and sampling: the validation loss of the model as it trains (of each source,
in nats per token and bits per byte: ``SourceValidation``), and a sample of generated text
at the end.

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
from pretrain.train.hooks import Hook

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
        return to_device(torch.cat([b[0] for b in batches]), self.device), \
            to_device(torch.cat([b[1] for b in batches]), self.device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device`` without making the host wait: a pageable copy to a GPU
    blocks until every kernel queued before it has run; a pinned one is queued like a
    kernel (and the pinned block is reused only once the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def sample(module, train_cfg, tokenizer: Path, device: torch.device) -> str | None:
    """``train.sample_tokens`` tokens generated from ``train.sample_prompt`` by the trained
    model (None when not asked for, or the layout splits the model)."""
    if train_cfg.sample_tokens <= 0:
        return None
    model, why_not = module.generator_model()
    if model is None:
        log.info("sampling skipped: %s", why_not)
        return None
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    prompt = tok(train_cfg.sample_prompt, add_special_tokens=False)["input_ids"] or [0]
    model.eval()
    # Same seed on every rank: data-parallel replicas draw the same tokens in lockstep.
    gen = torch.Generator(device=device).manual_seed(train_cfg.seed)
    with module.autocast():  # the compute dtype training ran in
        out = model.generate(
            torch.tensor([prompt], device=device), train_cfg.sample_tokens,
            temperature=train_cfg.sample_temperature, top_k=train_cfg.sample_top_k,
            generator=gen)
    return tok.decode(out[0].tolist())


class SampleHook(Hook):
    """``sample`` at the end of a run: logged, and in result.json as ``sample``. Every
    rank generates (data-parallel replicas in lockstep)."""

    name = "sample"

    def finish(self, trainer, result: dict) -> None:
        text = sample(trainer.module, trainer.cfg.train,
                      trainer.train_data.path / "tokenizer.json", trainer.device)
        if text is not None:
            log.info("sample from the trained model:\n%s\n%s\n%s", "-" * 60, text, "-" * 60)
            result["sample"] = text


# -- validation per source, in loss and bits per byte -------------------------------------------


def bits_per_byte(loss: float, tokens: int, nbytes: int) -> float:
    """Bits per byte of a mean loss of ``loss`` nats per token over text that ``tokens``
    tokens of ``nbytes`` UTF-8 bytes stand for: nats per byte over ln 2."""
    return loss * (tokens / nbytes) / math.log(2)


def weighted_mean(values: dict[str, float | None], weights: dict[str, float]) -> float | None:
    """The mean of ``values`` by ``weights`` over the names of positive weight (a weight-0
    source is validation only); None when one of them has no value."""
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


class SourceValidation(Hook):
    """The validation loss of each source at every evaluation point, in nats per token and
    in bits per byte (``bits_per_byte`` with the split's tokens and bytes as preparation
    counted them), reported as ``val_loss/<name>`` and ``val_bpb/<name>`` (log line,
    metrics.jsonl, wandb) and in result.json as ``val/<name>: {loss, bpb, weight}`` and
    ``final_val_bpb``. The run's ``val_loss`` becomes the training-weighted mean over the
    sources of positive weight: for one source, its loss, unchanged. The source the trainer
    evaluates itself (the same split) is not evaluated twice: its loss is the trainer's."""

    name = "validation"

    def __init__(self, sets: dict[str, TokenWindows], weights: dict[str, float],
                 make_evaluator: Callable[[TokenWindows], Evaluator], reuse: str | None = None):
        self.sets, self.weights, self.reuse = sets, weights, reuse
        self.evaluators = {n: make_evaluator(w) for n, w in sets.items() if n != reuse}
        self.counts = {n: w.text_bytes() for n, w in sets.items()}
        self.loss: dict[str, float | None] = {}
        self.bpb: dict[str, float | None] = {}
        self.described = False

    def describe(self) -> None:
        """Once, on rank 0: the sources validated on, and which have no byte counts."""
        log.info("validation per source: %s", ", ".join(
            f"{n} (weight {self.weights[n]:g}, {w.n_windows} windows)"
            for n, w in self.sets.items()))
        for n, counts in self.counts.items():
            if counts is None:
                log.warning(unavailable_note(n, self.sets[n].path))
        for ev in self.evaluators.values():
            ev.describe()

    def evaluate(self, trainer, metrics: dict) -> None:
        if trainer.rank0 and not self.described:
            self.describe()
        self.described = True
        for n in self.sets:
            loss = trainer.last_val_loss if n == self.reuse else self.evaluators[n].evaluate()
            counts = self.counts[n]
            self.loss[n] = loss
            self.bpb[n] = None if counts is None or loss is None else bits_per_byte(loss, *counts)
            metrics[f"val_loss/{n}"] = loss
            if self.bpb[n] is not None:
                metrics[f"val_bpb/{n}"] = self.bpb[n]
        metrics["val_loss"] = trainer.last_val_loss = weighted_mean(self.loss, self.weights)

    def finish(self, trainer, result: dict) -> None:
        for n in self.sets:
            entry = {"loss": self.loss.get(n), "bpb": self.bpb.get(n), "weight": self.weights[n]}
            if self.counts[n] is None:
                entry["bpb_unavailable"] = unavailable_note(n, self.sets[n].path)
            result[f"val/{n}"] = entry
        result["final_val_bpb"] = weighted_mean(self.bpb, self.weights)


def unavailable_note(name: str, path: Path) -> str:
    return (f"bits per byte unavailable for '{name}': {path} was prepared before preparation "
            f"counted the bytes of its text; move {path} aside and prepare it again "
            f"(`python tools/prepare_data.py data=...`) to get them")


def source_validation(trainer, sources: list[ValidationSource] | None = None
                      ) -> SourceValidation | None:
    """The per-source validation of ``trainer``'s run: ``sources``, by default its config's
    (``validation_sources``); None when none has a validation split. The trainer's own
    validation set, when it is one of them, is not evaluated twice."""
    own = trainer.val_data
    sets, weights = {}, {}
    for src in sources if sources is not None else validation_sources(trainer.cfg.data):
        # the trainer's own set when it is this source's split (a mixture's interleaved
        # validation, which has no single path, never is)
        own_path = getattr(own, "path", None)
        same = own_path is not None and Path(src.path).resolve() == Path(own_path).resolve()
        windows = own if same else open_validation(src.path, trainer.cfg.model.seq_len)
        if windows is not None:
            sets[src.name], weights[src.name] = windows, src.weight
    if not sets:
        return None
    reuse = next((n for n, w in sets.items() if w is own and trainer.evaluator), None)
    layout, place = trainer.layout, trainer.place

    def make(windows: TokenWindows) -> Evaluator:
        return Evaluator(windows, trainer.module, eval_batches=trainer.cfg.train.eval_batches,
                         micro_batch_size=layout.micro_batch_size, dp=layout.dp,
                         dp_rank=place.dp_rank, device=trainer.device)

    return SourceValidation(sets, weights, make, reuse)


def open_validation(path: Path, seq_len: int) -> TokenWindows | None:
    """The validation windows of the corpus at ``path``; None when it has no such split."""
    if "validation" not in load_index(Path(path))["splits"]:
        return None
    return TokenWindows(path, "validation", seq_len, shuffle=False)
