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
from pretrain.data.mixer import BatchMixer
from pretrain.data.source_checks import check_sources
from pretrain.data.tokenizer import check_document_token
from pretrain.data.weights import mixture_sources


class MixtureWindows:
    """The training windows of a mixture: ``batch(start, count)`` as TokenWindows has it,
    global sample ``i`` being position ``i mod B`` of batch ``i div B``."""

    def __init__(self, sources: list[TokenWindows], mixer: BatchMixer):
        self.sources, self.mixer = sources, mixer
        self.path = sources[0].path  # the shared tokenizer.json is there too
        self.seq_len = sources[0].seq_len

    def window(self, sample: int) -> np.ndarray:
        b, p = divmod(sample, self.mixer.batch)
        labels, local = self.mixer.layout(b)
        return self.sources[int(labels[p])].window(int(local[p]))

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.window(start + i) for i in range(count)]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


def open_mixture(cfg: Config, stages: Sequence[WeightStage]) -> MixtureWindows:
    """The mixture's training windows for its weights over steps (``stages``: the run's
    RunDecision.mixture_stages), after checking every source is prepared with one
    tokenizer, fits model.vocab_size and has the document token the model needs."""
    indexes = check_sources(cfg.data)
    sources, seq_len = mixture_sources(cfg.data), cfg.model.seq_len
    for (_, path, _), index in zip(sources, indexes, strict=True):
        check_vocab(path, index, cfg.model.vocab_size)
        check_document_token(cfg.model, index, path)
    train = [TokenWindows(p, "train", seq_len, seed=cfg.data.seed, stream=k + 1)
             for k, (_, p, _) in enumerate(sources)]
    return MixtureWindows(train, BatchMixer(stages, cfg.train.global_batch_size, cfg.data.seed))
