"""The corpus a run read, in tokens, as the scaling-law tools count it.

A single corpus: its prepared training tokens (the plan's ``data_tokens``). A mixture: the
training tokens at which its first source completes an epoch, min over sources of
``data_tokens / share`` (shares of the training samples, the plan's per-source ``weights``,
the largest of any stage). The mixture's total overstates it: the local mixture's 103.6M
tokens hold a 2.6M-token source, which a run at 0.2 of its samples repeats after 12.9M.
"""

from __future__ import annotations


def corpus_tokens(plan: dict) -> float | None:
    """Tokens of fresh data the run's corpus holds (None: the plan does not know)."""
    sources = plan.get("data_sources") or []
    limits = []
    for s in sources:
        share = max(s.get("weights") or [0.0])
        if share <= 0:
            continue  # validation-only: never trained on
        if not s.get("data_tokens"):
            limits = []
            break
        limits.append(s["data_tokens"] / share)
    if limits:
        return float(min(limits))
    total = plan.get("data_tokens")
    return float(total) if total else None
