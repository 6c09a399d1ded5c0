"""A weighted mixture of prepared corpora, exact in every global batch.

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

import json
import logging
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from pretrain.config.schema import Config, DataConfig
from pretrain.data.epochs import describe_sources
from pretrain.data.errors import DataError
from pretrain.data.loader import TokenWindows, check_vocab
from pretrain.data.tokenizer import check_document_token

log = logging.getLogger(__name__)
SCALE = 1 << 32
MIX_KEY = 0x6D6978  # "mix": the batch permutations' own seed stream
# The single-source keys a mixture leaves at data=mixture's values (conf/data/mixture.yaml).
SINGLE_SOURCE = {"name": "mixture", "source": "mixture", "subset": None, "revision": None,
                 "data_files": [], "roots": [], "max_documents": None, "tokens": None}
# An entry's preparation keys (mixture_prepare.py) that mean nothing without its source.
ENTRY_KEYS = ("subset", "revision", "data_files", "roots", "text_field", "max_documents",
              "validation_fraction")


def mixture_sources(cfg: DataConfig) -> list[tuple[str, Path, float]]:
    """(name, prepared path, weight) per source, in the order listed: the validation of
    every source (``TokenWindows(path, "validation", ...)``) iterates this."""
    return [(s.name, Path(cfg.root) / s.name, float(s.weight)) for s in cfg.mixture]


# -- the weights over steps ----------------------------------------------------------------


def weight_stages(cfg: DataConfig, decay_start: int | None = None
                  ) -> list[tuple[int, tuple[float, ...]]]:
    """(first step, weights per source) for each stage, in step order: the mixture's
    weights from step 0, each data.stages entry from its step, data.cooldown_weights from
    ``decay_start`` (a WSD schedule's). Step k's batch is the (k+1)-th optimizer step's."""
    names = [s.name for s in cfg.mixture]
    stages = {0: tuple(float(s.weight) for s in cfg.mixture)}
    for st in cfg.stages:
        stages[int(st.step)] = tuple(float(st.weights.get(n, 0.0)) for n in names)
    if cfg.cooldown_weights and decay_start is not None:
        stages[int(decay_start)] = tuple(float(cfg.cooldown_weights.get(n, 0.0))
                                         for n in names)
    return sorted(stages.items())


def _weights_problems(key: str, weights: dict[str, float], names: list[str]) -> list[str]:
    p = []
    unknown = [n for n in weights if n not in names]
    if unknown:
        p.append(f"{key} names {unknown}, not sources of data.mixture ({names}); use those "
                 "names (a source not listed gets weight 0)")
    if any(w < 0 for w in weights.values()):
        p.append(f"{key}={dict(weights)} has a negative weight; weights are shares >= 0")
    elif sum(weights.get(n, 0.0) for n in names) <= 0:
        p.append(f"{key}={dict(weights)} gives no source a positive weight; give at least "
                 "one source of data.mixture a weight > 0 (0 = validation only)")
    return p


def mixture_problems(cfg: DataConfig, decay: str) -> list[str]:
    """The config problems of a mixture (decision/checks.py lists them with the others);
    ``decay``: schedule.decay."""
    if not cfg.mixture:
        extra = [k for k in ("stages", "cooldown_weights") if getattr(cfg, k)]
        return [f"data.{k} needs data.mixture (a list of {{name, weight}} sources)"
                for k in extra]
    names = [s.name for s in cfg.mixture]
    p = [f"data.{k}={getattr(cfg, k)!r} is a single-source key: a mixture reads its sources' "
         f"prepared corpora; use data=mixture and leave data.{k} at {v!r} (each source "
         "is prepared on its own: docs/mixtures.md)"
         for k, v in SINGLE_SOURCE.items() if getattr(cfg, k) != v]
    if "" in names or len(set(names)) != len(names):
        p.append(f"data.mixture's names {names} must be distinct corpus names under data.root")
    p += _weights_problems("data.mixture", {s.name: s.weight for s in cfg.mixture}, names)
    p += [f"data.mixture[{i}] ({s.name}) sets {keys} but no source: add `source:` (how "
          "the one-job preparation builds it: stdlib, site-packages, local-docs, text, json, "
          "parquet or a hub name) or remove them (docs/mixtures.md)"
          for i, s in enumerate(cfg.mixture)
          if s.source is None and (keys := [k for k in ENTRY_KEYS
                                            if getattr(s, k, None) not in (None, [])])]
    steps = [int(st.step) for st in cfg.stages]
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)) or any(s < 0 for s in steps):
        p.append(f"data.stages steps {steps} must be >= 0 and strictly increasing: each "
                 "stage's weights apply from its step to the next stage's")
    for i, st in enumerate(cfg.stages):
        p += _weights_problems(f"data.stages[{i}].weights", dict(st.weights), names)
    if cfg.cooldown_weights:
        p += _weights_problems("data.cooldown_weights", dict(cfg.cooldown_weights), names)
        if decay != "wsd":
            p.append(f"data.cooldown_weights applies from a WSD schedule's decay start: use "
                     f"schedule=wsd (not decay={decay}), or data.stages with a step")
    return p


# -- the per-batch counts --------------------------------------------------------------------


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

    def __init__(self, stages: list[tuple[int, tuple[float, ...]]], batch: int, seed: int):
        self.starts = [int(s) for s, _ in stages]
        self.stages = [_Stage(w, batch) for _, w in stages]
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

    def layout(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of each of batch b's positions."""
        if b not in self._cache:
            counts = self.counts(b)
            labels = np.repeat(np.arange(len(counts)), counts)
            labels = labels[np.random.default_rng([self.seed, MIX_KEY, b]).permutation(
                self.batch)]
            local = np.empty(self.batch, dtype=np.int64)
            start = self.before(b)
            for s in range(len(counts)):
                pos = np.flatnonzero(labels == s)
                local[pos] = start[s] + np.arange(len(pos))
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[b] = labels, local
        return self._cache[b]


# -- windows ---------------------------------------------------------------------------------


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


# -- the data check ----------------------------------------------------------------------------


def _tokenizer_key(path: Path, index: dict) -> tuple:
    """What two sources must share: the vocabulary and merges, the EOS id, the size."""
    tok = path / "tokenizer.json"
    model = json.loads(tok.read_text()).get("model") if tok.exists() else index.get("tokenizer")
    return json.dumps(model, sort_keys=True), index["vocab_size"], index["eos_id"]


def _source_problem(i: int, name: str, path: Path) -> str | None:
    fix = (f"prepare it first: `python tools/prepare_data.py <the run's overrides>` when "
           f"data.mixture[{i}] has a `source:`, else `python tools/prepare_data.py data=... "
           f"data.name={name} data.root={path.parent}` (docs/mixtures.md), or correct "
           f"data.mixture[{i}].name")
    if not (path / "index.json").exists():
        return f"data.mixture[{i}].name={name}: no prepared data at {path}; {fix}"
    index = json.loads((path / "index.json").read_text())
    train = index.get("splits", {}).get("train", {})
    if not train.get("shards") or not train.get("tokens"):
        return f"data.mixture[{i}].name={name}: {path} holds no training files; {fix}"
    return None


def tokenizer_problem(found: list[tuple[str, Path, dict]]) -> str | None:
    """The problem when prepared sources (name, dir, index) differ from the first's
    tokenizer, else None."""
    if not found:
        return None
    first = _tokenizer_key(found[0][1], found[0][2])
    other = [n for n, p, ix in found[1:] if _tokenizer_key(p, ix) != first]
    if not other:
        return None
    return (f"data.mixture sources {other} have another tokenizer or vocabulary than "
            f"{found[0][0]}: a mixture needs one; prepare them with data.tokenizer="
            f"{found[0][1] / 'tokenizer.json'} (docs/mixtures.md), or move them aside and "
            "prepare the mixture as one job (tools/prepare_data.py with the mixture)")


def check_sources(cfg: DataConfig) -> list[dict]:
    """The sources' indexes, or one DataError listing every source that is not prepared,
    has no files, or has another tokenizer than the first."""
    problems, indexes = [], []
    for i, (name, path, _) in enumerate(mixture_sources(cfg)):
        problem = _source_problem(i, name, path)
        problems += [problem] if problem else []
        indexes.append(None if problem else json.loads((path / "index.json").read_text()))
    found = [(n, p, ix) for (n, p, _), ix in zip(mixture_sources(cfg), indexes, strict=True)
             if ix is not None]
    problem = tokenizer_problem(found)
    problems += [problem] if problem else []
    if problems:
        raise DataError("the mixture's sources are not ready:\n" +
                        "\n".join(f"  - {p}" for p in problems))
    return indexes


def open_mixture(cfg: Config, plan: dict, prepare: bool = False) -> MixtureWindows:
    """The mixture's training windows (each source's validation split is evaluated on its
    own, train/evaluation.Validation: the run's val_loss is their mean weighted by
    data.mixture, evaluation.mixture_mean); ``plan``: the run's, with ``mixture_stages`` and ``data_sources`` (decision/resolve.py).
    ``prepare`` (a one-process run): first prepare the sources that say how they are built
    and are not prepared yet, when data.auto_prepare (mixture_prepare.py)."""
    if prepare:
        from pretrain.data.mixture_prepare import prepare_for_run  # it imports this module

        prepare_for_run(cfg, plan)
    indexes = check_sources(cfg.data)
    sources, seq_len = mixture_sources(cfg.data), cfg.model.seq_len
    for (_, path, _), index in zip(sources, indexes, strict=True):
        check_vocab(path, index, cfg.model.vocab_size)
        check_document_token(cfg.model, index, path)
    log.info("data: a mixture of %d sources\n%s", len(sources),
             "\n".join(describe_sources(plan["data_sources"])))
    train = [TokenWindows(p, "train", seq_len, seed=cfg.data.seed, stream=k + 1)
             for k, (_, p, _) in enumerate(sources)]
    mixer = BatchMixer([(int(s), tuple(w)) for s, w in plan["mixture_stages"]],
                       cfg.train.global_batch_size, cfg.data.seed)
    return MixtureWindows(train, mixer)


@dataclass(frozen=True)
class SourceShare:
    """What the plan states of one source."""

    name: str
    weights: list[float]  # per stage
    tokens: int  # the budget's tokens from it
    data_tokens: int | None  # its prepared training tokens (None: not prepared)

    @property
    def epochs(self) -> float | None:
        return None if not self.data_tokens else self.tokens / self.data_tokens


def source_shares(cfg: DataConfig, stages: list, batch: int, steps: int, seq_len: int
                  ) -> list[SourceShare]:
    """Per source: its weights, the tokens ``steps`` batches take from it (exact counts),
    its prepared size."""
    samples = BatchMixer(stages, batch, cfg.seed).before(steps)
    out = []
    for k, (name, path, _) in enumerate(mixture_sources(cfg)):
        index = path / "index.json"
        size = (int(json.loads(index.read_text())["splits"]["train"]["tokens"])
                if index.exists() else None)
        out.append(SourceShare(name, [float(w[k]) for _, w in stages],
                               int(samples[k]) * seq_len, size))
    return out
