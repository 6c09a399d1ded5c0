"""A mixture's training windows: global sample ``i`` is position ``i mod B`` of global
batch ``i div B``, whose source and sample within it the mixer (mixer.py) gives, read from
that source's own TokenWindows (loader.py, seeded by (data.seed, k + 1, epoch)). Each
source's validation split is evaluated on its own (train/evaluation.Validation: the run's
val_loss is their mean weighted by data.mixture, evaluation.mixture_mean)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pretrain.config.decision import WeightStage
from pretrain.config.schema import Config
from pretrain.data.loader import TokenWindows, check_vocab
from pretrain.data.mixer import BatchMixer, RampMixer
from pretrain.data.source_checks import check_sources
from pretrain.data.tokenizer import check_document_token
from pretrain.data.weights import mixture_sources


class MixtureWindows:
    """The training windows of a mixture: ``batch(start, count)`` as TokenWindows has it,
    global sample ``i`` being position ``i mod B`` of batch ``i div B``."""

    def __init__(self, sources: list[TokenWindows], mixer: BatchMixer | RampMixer):
        self.sources, self.mixer = sources, mixer
        self.path = sources[0].path  # the shared tokenizer.json is there too
        self.seq_len = sources[0].seq_len

    def window(self, sample: int) -> np.ndarray:
        b, p = self.mixer.locate(sample)
        labels, local = self.mixer.layout(b)
        return self.sources[int(labels[p])].window(int(local[p]))

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.window(start + i) for i in range(count)]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


def open_mixture(cfg: Config, stages: Sequence[WeightStage], batch_of=None) -> MixtureWindows:
    """The mixture's training windows for its weights over steps (``stages``: the run's
    RunDecision.mixture_stages), after checking every source is prepared with one
    tokenizer, fits model.vocab_size and has the document token the model needs.
    ``batch_of``: a batch ramp's size of the batch that starts at a sample (None: the full
    batch): its batches are the mixer's (RampMixer), so each holds the shares."""
    indexes = check_sources(cfg.data)
    sources, seq_len = mixture_sources(cfg.data), cfg.model.seq_len
    for (_, path, _), index in zip(sources, indexes, strict=True):
        check_vocab(path, index, cfg.model.vocab_size)
        check_document_token(cfg.model, index, path)
    train = [TokenWindows(p, "train", seq_len, seed=cfg.data.seed, stream=k + 1)
             for k, (_, p, _) in enumerate(sources)]
    full = cfg.train.global_batch_size
    mixer = (
        BatchMixer(stages, full, cfg.data.seed)
        if batch_of is None
        else RampMixer(stages, full, cfg.data.seed, batch_of)
    )
    return MixtureWindows(train, mixer)
