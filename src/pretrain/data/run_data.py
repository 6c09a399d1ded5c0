"""What a run reads: its training (and validation) windows, one corpus or a mixture, and
the plan's data entries restated once the data exists. One process prepares what is missing
first (``data.auto_prepare``); a multi-process run checks first that everything is prepared
(``require_prepared``: preparing a real corpus is a job of its own, tools/prepare_data.py,
not work for rank 0 while the other ranks wait on a collective's timeout)."""

from __future__ import annotations

import logging

from pretrain.config.decision import RunDecision
from pretrain.config.schema import Config
from pretrain.data.epochs import (
    check_epochs,
    check_mixture_epochs,
    describe_sources,
    source_entries,
)
from pretrain.data.errors import DataError
from pretrain.data.loader import TokenWindows, check_vocab
from pretrain.data.mixture_prepare import needs_mixture_preparation, prepare_mixture
from pretrain.data.mixture_windows import MixtureWindows, open_mixture
from pretrain.data.prepare import INDEX, data_dir, load_index, needs_preparation, prepare
from pretrain.data.source_checks import check_sources
from pretrain.data.tokenizer import check_document_token
from pretrain.data.weights import source_shares

log = logging.getLogger("pretrain")


def training_data(cfg: Config, world_size: int, budget_tokens: int
                  ) -> tuple[TokenWindows, TokenWindows | None, dict]:
    """The training and (when prepared) validation windows, and the epochs the budget takes
    (``check_epochs``, for the plan). One process prepares the shards on first use
    (``data.auto_prepare``); a multi-process run has checked before it started that they
    exist (preparing a real corpus is a job of its own, tools/prepare_data.py, not work for
    rank 0 while the other ranks wait on a collective's timeout)."""
    path = data_dir(cfg.data)
    if world_size == 1 and cfg.data.auto_prepare:
        path = prepare(cfg.data)
    index = load_index(path)
    check_vocab(path, index, cfg.model.vocab_size)
    check_document_token(cfg.model, index, path)
    epochs = check_epochs(cfg.data, budget_tokens, index)
    log.info("data %s: %s training tokens, the budget is %.3g epochs of it", path,
             f"{epochs['data_tokens']:,}", epochs["epochs"])
    train = TokenWindows(path, "train", cfg.model.seq_len, seed=cfg.data.seed)
    val = (TokenWindows(path, "validation", cfg.model.seq_len, shuffle=False)
           if "validation" in train.index["splits"] else None)
    return train, val, epochs


def mixture_training_data(cfg: Config, decision: RunDecision, world_size: int, steps: int,
                          batch_of=None) -> tuple[MixtureWindows, dict]:
    """A mixture's training windows for ``decision``'s weights over steps, and the plan's
    data entries restated when this call prepared sources (else {}: the plan's stand).
    One process first prepares the sources that say how they are built and are not
    prepared yet, when data.auto_prepare (mixture_prepare.py). ``batch_of``: a batch
    ramp's batch sizes (mixture_windows.open_mixture)."""
    shares, entries = decision.sources, {}
    if world_size == 1 and needs_mixture_preparation(cfg.data):
        prepare_mixture(cfg.data)
        shares = source_shares(cfg.data, decision.mixture_stages, cfg.train.global_batch_size,
                               steps, cfg.model.seq_len)
        entries = check_mixture_epochs(cfg.data, shares)
    train = open_mixture(cfg, decision.mixture_stages, batch_of)
    log.info("data: a mixture of %d sources\n%s", len(shares),
             "\n".join(describe_sources(source_entries(shares))))
    return train, entries


def require_prepared(cfg: Config) -> None:
    """A multi-process run reads prepared data and never tokenises: DataError, naming the
    command that prepares it, when there is none for this data config (``cfg``: the run's
    Config; with ``data.auto_prepare=false`` any prepared index at the path will do)."""
    if cfg.data.mixture:  # its sources are prepared corpora, each checked by name
        check_sources(cfg.data)
        return
    path = data_dir(cfg.data)
    if not needs_preparation(cfg.data) and (path / INDEX).exists():
        return
    what = ("was prepared with other settings" if (path / INDEX).exists()
            else "holds no prepared data")
    raise DataError(
        f"{path} {what} (data.name={cfg.data.name}), and a multi-process run does not "
        f"prepare data: prepare it first with `python tools/prepare_data.py <the same "
        f"overrides>`, or start the run with `python tools/run_local.py` / "
        f"`tools/launch.py`, which prepare first")
