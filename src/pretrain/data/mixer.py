"""The mixer: which source, and which of its samples, each position of each global batch
takes, for a mixture's weights over steps (weights.py decides them).

The anchors are OLMo-core's ``SourceMixtureDatasetConfig`` (target ratios, exact by
largest-remainder rounding), Megatron's ``BlendedDataset`` and Levanter's block-deterministic
mixture (any global index maps to a source and an offset by a pure function; weight 0 =
validation only; weights that change at given steps). Here the block is the global batch:

* Batch ``b`` (``B`` = train.global_batch_size samples) uses the weights of the stage it
  falls in. Source ``s`` gets ``floor(w_s B)`` samples, and the ``r`` seats left over go to
  the ``r`` sources whose running share is furthest below ``w_s B`` per batch (largest
  remainder on the cumulative deficit, ties to the first listed): every batch holds each
  source within one sample of ``w_s B``, and over many batches the shares stay within a
  sample of the weights. Exact integer arithmetic (quotas in units of 2^-32 samples).
* The batch's ``B`` positions are a permutation seeded by (data.seed, b) of those labels.
* The position's sample of source ``s`` is the next one of that source: its index within
  the source is the number of samples of ``s`` in batches before ``b`` plus its rank among
  the batch's ``s`` positions; the source's own ``TokenWindows`` (seeded by (data.seed,
  k + 1, epoch)) maps it to a window, epoch after epoch.

Everything is a function of (seed, weights, B, b): any rank computes its slice of any batch,
and resume and re-layout need no loader state (the position stays global samples
consumed). The counts before batch ``b`` are cached per stage, computed once, O(batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from pretrain.config.decision import WeightStage

SCALE = 1 << 32
MIX_KEY = 0x6D6978  # "mix": the batch permutations' own seed stream


class _Stage:
    """One stage's per-batch counts: base floor(w B) plus 0/1 extras, by cumulative deficit."""

    def __init__(self, weights: tuple[float, ...], batch: int):
        exact = [Fraction(w) / sum(Fraction(x) for x in weights) * batch * SCALE
                 for w in weights]
        q = [int(x) for x in exact]  # floor: non-negative
        order = sorted(range(len(q)), key=lambda s: (-(exact[s] - q[s]), s))
        for s in order[: batch * SCALE - sum(q)]:  # largest remainder to B * SCALE exactly
            q[s] += 1
        self.base = np.array([x // SCALE for x in q], dtype=np.int64)
        self.frac = [x % SCALE for x in q]
        self.r = sum(self.frac) // SCALE
        self.candidates = [s for s, f in enumerate(self.frac) if f > 0]
        self.extras = np.zeros((1, len(q)), dtype=np.int64)  # extras before batch k (row k)
        self._done = 0

    def _grow(self, k: int) -> None:
        if k < len(self.extras):
            return
        rows = max(k + 1, len(self.extras) + 4096)
        out = np.zeros((rows, self.extras.shape[1]), np.int64)
        out[: len(self.extras)] = self.extras
        e = [int(x) for x in self.extras[self._done]]
        for j in range(self._done, len(out) - 1):
            deficit = {s: self.frac[s] * (j + 1) - e[s] * SCALE for s in self.candidates}
            for s in sorted(self.candidates, key=lambda s: (-deficit[s], s))[: self.r]:
                e[s] += 1
            out[j + 1] = e
        self.extras, self._done = out, len(out) - 1

    def before(self, k: int) -> np.ndarray:
        """Samples per source in this stage's batches 0 .. k-1."""
        self._grow(k)
        return self.base * k + self.extras[k]

    def counts(self, k: int) -> np.ndarray:
        return self.before(k + 1) - self.before(k)


class BatchMixer:
    """Which source, and which of its samples, each position of each global batch takes."""

    def __init__(self, stages: Sequence[WeightStage], batch: int, seed: int):
        self.starts = [st.step for st in stages]
        self.stages = [_Stage(st.weights, batch) for st in stages]
        self.batch, self.seed = batch, seed
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _stage_of(self, b: int) -> int:
        return int(np.searchsorted(self.starts, b, side="right")) - 1

    def before(self, b: int) -> np.ndarray:
        """Samples per source in global batches 0 .. b-1."""
        j = self._stage_of(b)
        total = self.stages[j].before(b - self.starts[j])
        for i in range(j):
            total = total + self.stages[i].before(self.starts[i + 1] - self.starts[i])
        return total

    def counts(self, b: int) -> np.ndarray:
        """Samples per source in global batch b."""
        j = self._stage_of(b)
        return self.stages[j].counts(b - self.starts[j])

    def locate(self, sample: int) -> tuple[int, int]:
        """(batch, position in it) of global sample ``sample``."""
        return divmod(sample, self.batch)

    def layout(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of each of batch b's positions."""
        if b not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[b] = shuffled_layout(self.seed, b, self.counts(b), self.before(b))
        return self._cache[b]


class RampMixer:
    """The mixer for batches of changing size (a batch ramp): batch ``b`` holds
    ``batch_of(first sample of b)`` samples, each source ``floor(w_s B_b)`` plus 0/1 extras
    by cumulative deficit, as BatchMixer's (the deficit summing each batch's remainders), so
    every batch holds each source within one sample of ``w_s B_b`` whatever its size; with
    a constant size it is BatchMixer, position for position (tests/test_batch_ramp.py).
    ``stages``' steps are steps of the full batch ``full``: batch ``b`` takes the weights of
    the stage its first sample falls in. Batches are laid out on first use, in order."""

    def __init__(self, stages: Sequence[WeightStage], full: int, seed: int, batch_of):
        self.stage_starts = [st.step * full for st in stages]
        self.weights = [st.weights for st in stages]
        self.full, self.seed, self.batch_of = full, seed, batch_of
        self.firsts = [0]  # first sample of each batch laid out so far, and the next one's
        self.rows: list[np.ndarray] = []  # per-source counts of each batch
        self.befores: list[np.ndarray] = []  # per-source counts before each batch
        self._quotas: dict[tuple[int, int], _Stage] = {}
        self._stage = -1
        self._frac_sum = self._extras = None
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _quota(self, j: int, size: int) -> _Stage:
        if (j, size) not in self._quotas:
            self._quotas[(j, size)] = _Stage(self.weights[j], size)
        return self._quotas[(j, size)]

    def _grow(self, sample: int) -> None:
        """Lay out batches until one holds ``sample``."""
        while self.firsts[-1] <= sample:
            first = self.firsts[-1]
            size = int(self.batch_of(first))
            j = int(np.searchsorted(self.stage_starts, first, side="right")) - 1
            q = self._quota(j, size)
            n = len(q.base)
            if j != self._stage:  # a new stage: its own deficits, as BatchMixer's _Stage
                self._stage, self._frac_sum, self._extras = j, [0] * n, [0] * n
            f, e = self._frac_sum, self._extras
            for s in range(n):
                f[s] += q.frac[s]
            deficit = {s: f[s] - e[s] * SCALE for s in q.candidates}
            add = np.zeros(n, dtype=np.int64)
            for s in sorted(q.candidates, key=lambda s: (-deficit[s], s))[: q.r]:
                e[s] += 1
                add[s] = 1
            before = self.befores[-1] + self.rows[-1] if self.rows else np.zeros(n, np.int64)
            self.befores.append(before)
            self.rows.append(q.base + add)
            self.firsts.append(first + size)

    def locate(self, sample: int) -> tuple[int, int]:
        """(batch, position in it) of global sample ``sample``."""
        self._grow(sample)
        b = int(np.searchsorted(self.firsts, sample, side="right")) - 1
        return b, sample - self.firsts[b]

    def counts(self, b: int) -> np.ndarray:
        """Samples per source in batch b."""
        while len(self.rows) <= b:
            self._grow(self.firsts[-1])  # one more batch
        return self.rows[b]

    def layout(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of each of batch b's positions."""
        if b not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[b] = shuffled_layout(self.seed, b, self.counts(b), self.befores[b])
        return self._cache[b]


def shuffled_layout(seed: int, b: int, counts: np.ndarray, start: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(source, index within the source) of each position of batch ``b``, which holds
    ``counts`` samples of each source, the source's first being its ``start``: the sources'
    samples in a shuffle that is a pure function of (seed, b)."""
    size = int(counts.sum())
    labels = np.repeat(np.arange(len(counts)), counts)
    labels = labels[np.random.default_rng([seed, MIX_KEY, b]).permutation(size)]
    local = np.empty(size, dtype=np.int64)
    for s in range(len(counts)):
        pos = np.flatnonzero(labels == s)
        local[pos] = start[s] + np.arange(len(pos))
    return labels, local
