"""How many epochs of the ladder's corpus a scaling-law target would train on.

A ladder whose runs each read fresh tokens (at most one epoch) fits the loss of fresh data.
A target whose tokens exceed that corpus would repeat it, and repeated tokens are worth less
(Muennighoff et al. 2023: about as good as fresh up to ~4 epochs, then falling fast), so the
fit predicts a loss the run cannot reach on that corpus: a ladder on the 2.6M-token embedded
corpus predicted a run at 36x its largest compute at 4.26, and the run, 2.2 epochs, measured
5.12 (issue 37). The target's tokens D are the law's own: L(C)'s at the ladder's tokens per
parameter (D = sqrt(C r / 6)), L(N, D)'s its compute-optimal D_opt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import compute_frontier


def ladder_tokens_per_param(points: Sequence[RunPoint]) -> float:
    """r = D / N of the compute frontier (geometric mean): the split L(C) was fitted at."""
    front = compute_frontier(points)
    return math.exp(sum(math.log(p.tokens / p.n_params) for p in front) / len(front))


def corpus_tokens(points: Sequence[RunPoint]) -> float | None:
    """The smallest corpus any of the runs read (None: no run's plan knows its size)."""
    sizes = [p.data_tokens for p in points if p.data_tokens]
    return min(sizes) if sizes else None


def target_epochs(points: Sequence[RunPoint], target_flops: float,
                  d_opt: float | None = None) -> tuple[dict, list[str]]:
    """(for fit.json: the corpus, the target's tokens and epochs by law; warnings where a
    target's tokens exceed the corpus the ladder was fitted on)."""
    corpus = corpus_tokens(points)
    if corpus is None or not points:
        return {}, []
    r = ladder_tokens_per_param(points)
    tokens = {"L(C)": math.sqrt(target_flops * r / 6)}
    if d_opt:
        tokens["L(N, D)"] = d_opt
    seen = max(p.tokens / p.data_tokens for p in points if p.data_tokens)
    record = {"corpus_tokens": corpus, "ladder_max_epochs": seen,
              "target_tokens": tokens, "target_epochs": {k: d / corpus for k, d in tokens.items()}}
    warnings = []
    for law, d in tokens.items():
        if d <= corpus:
            continue
        how = (f"at the ladder's {r:.3g} tokens per parameter" if law == "L(C)"
               else "its compute-optimal D_opt")
        warnings.append(
            f"the target C = {target_flops:.3g} trains on {d:,.0f} tokens by {law} ({how}): "
            f"{d / corpus:.2f} epochs of the {corpus:,.0f}-token corpus the ladder was fitted "
            f"on (its runs: at most {seen:.2f}); the fit predicts fresh data and repeated "
            f"tokens are worth less (Muennighoff et al. 2023): use a corpus of at least "
            f"{d:,.0f} tokens, or a target of at most C = {6 * corpus ** 2 / r:.3g} (one epoch "
            f"at {r:.3g} tokens per parameter)")
    return record, warnings
