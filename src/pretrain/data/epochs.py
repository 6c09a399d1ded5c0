"""How many times a run's token budget goes through its corpus.

Repeating data past about four epochs stops paying (Muennighoff et al. 2023, "Scaling
Data-Constrained Language Models": up to ~4 epochs are nearly as good as fresh tokens,
after that the returns fall quickly), so the epoch count is part of what a run resolves:
more than one is a warning, more than ``data.max_epochs`` a configuration error.

The corpus size comes from the prepared index when the data is prepared (exact), else from
the size the data config declares (``data.tokens``, taken from the dataset's card), else it
is unknown until preparation, and the trainer checks again once the index exists.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pretrain.config.decision import SourceShare
from pretrain.config.schema import ConfigError, DataConfig
from pretrain.data.prepare import prepared_index

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorpusSize:
    tokens: int | None  # training-split tokens; None: unknown until prepared
    source: str  # "prepared" | "declared" | "unknown"

    def describe(self) -> str:
        if self.tokens is None:
            return "size unknown until prepared"
        return f"{self.tokens:,} tokens ({self.source})"


def corpus_size(cfg: DataConfig, index: dict | None = None) -> CorpusSize:
    """Training tokens of the corpus: prepared (exact) > declared (data.tokens) > unknown."""
    index = index if index is not None else prepared_index(cfg)
    if index is not None:
        return CorpusSize(int(index["splits"]["train"]["tokens"]), "prepared")
    if cfg.tokens is not None and cfg.max_documents is None:
        return CorpusSize(int(cfg.tokens * (1 - cfg.validation_fraction)), "declared")
    return CorpusSize(None, "unknown")


def epochs(budget_tokens: int, size: CorpusSize) -> float | None:
    return None if not size.tokens else budget_tokens / size.tokens


def check_epochs(cfg: DataConfig, budget_tokens: int, index: dict | None = None) -> dict:
    """The plan's data entries ({data_tokens, data_tokens_from, epochs}); warns above one
    epoch and raises ConfigError above ``cfg.max_epochs``."""
    size = corpus_size(cfg, index)
    n = epochs(budget_tokens, size)
    entry = {"data_tokens": size.tokens, "data_tokens_from": size.source,
             "epochs": None if n is None else round(n, 3)}
    if n is None:
        return entry
    if n > cfg.max_epochs:
        raise ConfigError([
            f"the budget of {budget_tokens:,} tokens is {n:.1f} epochs of data.name="
            f"{cfg.name} ({size.describe()}), more than data.max_epochs={cfg.max_epochs:g}; "
            f"repeated data stops paying after about 4 epochs. Use a larger corpus (data=...), "
            f"a smaller budget (budget.*), or raise data.max_epochs={n:.1f} if you mean it"])
    if n > 1:
        log.warning("the budget of %s tokens goes %.2f times through data.name=%s (%s): "
                    "each document is seen about %.1f times", f"{budget_tokens:,}", n,
                    cfg.name, size.describe(), n)
    return entry


def source_entries(shares: Sequence[SourceShare]) -> list[dict]:
    """The plan's ``data_sources``: per source its weights, the tokens the budget takes
    from it, its prepared size and epochs."""
    return [{"name": s.name, "weights": list(s.weights), "tokens": s.tokens,
             "data_tokens": s.data_tokens,
             "epochs": None if s.epochs is None else round(s.epochs, 3)} for s in shares]


def check_mixture_epochs(cfg: DataConfig, shares: Sequence[SourceShare]) -> dict:
    """The plan's data entries of a mixture: per source (``data_sources``) its weights, the
    tokens the budget takes from it, its prepared size and epochs; ``data.max_epochs`` and
    the repetition warning apply to each source (a small source repeats long before the
    mix does). ``shares``: data/weights.source_shares."""
    sizes = [s.data_tokens for s in shares]
    total = None if None in sizes else sum(sizes)
    budget = sum(s.tokens for s in shares)
    entry = {"data_tokens": total, "data_tokens_from": "prepared" if total else "unknown",
             "epochs": None if not total else round(budget / total, 3),
             "data_sources": source_entries(shares)}
    over = [s for s in shares if s.epochs is not None and s.epochs > cfg.max_epochs]
    if over:
        raise ConfigError([
            f"the budget takes {s.tokens:,} tokens from data.mixture source {s.name} "
            f"({s.data_tokens:,} prepared), {s.epochs:.1f} epochs of it, more than "
            f"data.max_epochs={cfg.max_epochs:g}; repeated data stops paying after about 4 "
            f"epochs. Lower its weight, prepare more of it, shrink the budget, or raise "
            f"data.max_epochs={s.epochs:.1f} if you mean it" for s in over])
    for s in shares:
        if s.epochs is not None and s.epochs > 1:
            log.warning("the budget goes %.2f times through data.mixture source %s (%s of "
                        "its %s tokens): each of its documents is seen about %.1f times",
                        s.epochs, s.name, f"{s.tokens:,}", f"{s.data_tokens:,}", s.epochs)
    return entry


def describe_sources(entries: list[dict]) -> list[str]:
    """One line per source of a plan's ``data_sources``."""
    return [f"  {e['name']}: weight(s) {'/'.join(f'{w:g}' for w in e['weights'])}, "
            f"{e['tokens']:,} tokens of the budget, "
            + (f"{e['data_tokens']:,} prepared: {e['epochs']:.3g} epochs"
               if e["data_tokens"] else "not prepared yet") for e in entries]
