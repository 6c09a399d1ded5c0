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
from dataclasses import dataclass

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
