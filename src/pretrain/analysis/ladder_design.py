"""A scaling ladder's design, stated and checked before any of it runs.

A ladder predicts only what its runs can identify. The ladders this project ran first missed a
run at 30x their compute by 15-20% (docs/benchmarks.md) for reasons a plan shows before any
compute is spent: rungs whose parameters were mostly the embedding, every rung stopped far
below the target's tokens per parameter (so the fit never saw the N term), sizes within 2x
of each other. :func:`design` turns a recipe's sizes, its token multiples (WSD branch points
plus the source run's budget), the measured speed of each size and a compute budget into the
full plan: every run's tokens, compute and expected seconds, the held-out run that checks the
prediction, each corpus source's epochs; :func:`problems` lists what makes the design unable
to identify L(N, D) or unable to fit the budget, each with the knob that fixes it.

The rules (published ladders that predict: OLMo's 4 sizes x 4 lengths at 1-10x Chinchilla,
Porian et al. 2024, Hoffmann et al. 2022 approaches 2 and 3):

- at least ``MIN_SIZES`` sizes spanning ``MIN_SPAN`` x in non-embedding parameters, no head
  narrower than ``MIN_HEAD_WIDTH``, the embedding at most ``MAX_EMBEDDING`` of a rung;
- at least three token multiples per size, and the held-out run's tokens per parameter
  inside their span (a ladder whose runs all stop below it is data-limited: it measures the
  data term only and extrapolates the rest);
- the held-out run at ``ratio`` x the largest rung's compute C = 6 N D, at the tokens per
  parameter a fit (or, before one, Chinchilla's 20) calls compute-optimal, under one epoch
  of every source;
- the whole study within the budget, planned in measured seconds per size (small models are
  bound by per-op overhead on a CPU, not by FLOPs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_SIZES = 5
MIN_SPAN = 16.0
MIN_HEAD_WIDTH = 16
MAX_EMBEDDING = 0.25
MIN_MULTIPLES = 3
CHINCHILLA_TPP = 20.0


@dataclass(frozen=True)
class Size:
    """One model size of the ladder's rule, as the recipe composes it (a dry run's plan)."""

    width: int
    n_layer: int
    n_head: int
    n_params: int
    n_params_non_embedding: int
    flops_per_token: int
    lr: float
    tokens_per_s: float | None = None  # measured, at the ladder's threads per run
    batch_tokens: int | None = None  # this size's global batch (None: the design's)

    @property
    def head_width(self) -> int:
        return self.width // self.n_head

    @property
    def embedding_fraction(self) -> float:
        return 1.0 - self.n_params_non_embedding / self.n_params


@dataclass(frozen=True)
class Run:
    """One training run of the plan: a WSD source run (to the top multiple) or a branch."""

    width: int
    tokens_per_param: float
    tokens: int
    compute: float  # C = 6 N D
    seconds: float | None  # tokens actually trained / measured tokens per second
    branch: bool
    seed: int | None = None  # None: the recipe's


@dataclass
class Design:
    sizes: list[Size]
    multiples: list[float]  # ascending; the last is the source runs' budget
    decay_fraction: float
    batch_tokens: int
    seed_widths: list[int]
    ratio: float
    target_tpp: float
    target_tpp_from: str
    heldout: Size
    heldout_compute: float
    heldout_tokens: int
    heldout_seconds: float | None
    heldout_threads: int
    jobs: int
    sources: list[dict] = field(default_factory=list)  # name, weight, data_tokens
    runs: list[Run] = field(default_factory=list)
    budget_seconds: float | None = None  # core-seconds the study may use
    budget_flops: float | None = None
    # runs shorter than this are in their warm-up transient (the fit's --min-steps)
    min_steps: int = 0

    @property
    def largest(self) -> Size:
        return max(self.sizes, key=lambda s: s.n_params)

    @property
    def largest_compute(self) -> float:
        return max(r.compute for r in self.runs)

    @property
    def span(self) -> float:
        ne = [s.n_params_non_embedding for s in self.sizes]
        return max(ne) / min(ne)

    @property
    def ladder_core_seconds(self) -> float | None:
        if any(r.seconds is None for r in self.runs):
            return None
        return sum(r.seconds for r in self.runs)

    @property
    def ladder_wall_seconds(self) -> float | None:
        """Wall time with the runs of each size in one stream and ``jobs`` streams at
        once, sizes dealt out largest first to the stream with the least work."""
        per_size: dict[tuple[int, int | None], float] = {}
        for r in self.runs:
            if r.seconds is None:
                return None
            per_size[(r.width, r.seed)] = per_size.get((r.width, r.seed), 0.0) + r.seconds
        streams = [0.0] * max(1, min(self.jobs, len(per_size)))
        for t in sorted(per_size.values(), reverse=True):
            streams[streams.index(min(streams))] += t
        return max(streams)

    @property
    def study_core_seconds(self) -> float | None:
        ladder = self.ladder_core_seconds
        if ladder is None or self.heldout_seconds is None:
            return None
        return ladder + self.heldout_seconds * self.heldout_threads

    @property
    def study_flops(self) -> float:
        return sum(r.compute for r in self.runs) + self.heldout_compute

    def batch_of(self, width: int) -> int:
        size = next((s for s in self.sizes if s.width == width), None)
        return (size.batch_tokens if size and size.batch_tokens else self.batch_tokens)

    def short_runs(self) -> list[Run]:
        """Runs of fewer than ``min_steps`` steps, which the fit leaves out."""
        return [r for r in self.runs if r.tokens / self.batch_of(r.width) < self.min_steps]

    @property
    def backtest_ratio(self) -> float:
        """The largest R at which the fitted runs can be backtested (analysis/backtest.py):
        fitted below C_max / R, the top rungs predicted."""
        from pretrain.analysis.backtest import max_ratio

        short = self.short_runs()
        kept = [r for r in self.runs if r not in short and r.seed is None]
        n = {s.width: s.n_params for s in self.sizes}
        return max_ratio([r.compute for r in kept], [n[r.width] for r in kept],
                         [r.tokens for r in kept]) if kept else 1.0

    def epochs(self, tokens: float) -> dict[str, float]:
        """Epochs of each source a run of ``tokens`` tokens reads (its share of them)."""
        return {s["name"]: tokens * s["weight"] / s["data_tokens"]
                for s in self.sources if s.get("data_tokens") and s["weight"] > 0}


def trained_tokens(size: Size, tpp: float, batch_tokens: int) -> int:
    """Tokens a run of ``tpp`` tokens per parameter trains: whole steps, as the budget rounds."""
    return max(1, math.ceil(tpp * size.n_params / batch_tokens)) * batch_tokens


def plan_runs(sizes: list[Size], multiples: list[float], decay_fraction: float,
              batch_tokens: int, seed_widths: list[int], extra_seed: int) -> list[Run]:
    """The source run of each size (to the top multiple) and its branches (each trains the
    last ``decay_fraction`` of its budget from the branch point), then the same for every
    size in ``seed_widths`` at ``extra_seed``."""
    runs = []
    for seed, widths in ((None, [s.width for s in sizes]), (extra_seed, seed_widths)):
        for s in sizes:
            if s.width not in widths:
                continue
            for i, m in enumerate(multiples):
                tokens = trained_tokens(s, m, s.batch_tokens or batch_tokens)
                branch = i < len(multiples) - 1
                trained = decay_fraction * tokens if branch else tokens
                sec = trained / s.tokens_per_s if s.tokens_per_s else None
                runs.append(Run(s.width, m, tokens, 6.0 * s.n_params * tokens, sec, branch, seed))
    return runs


def optimal_params(compute: float, tpp: float) -> float:
    """N of a run at ``tpp`` tokens per parameter that costs ``compute`` = 6 N D."""
    return math.sqrt(compute / (6.0 * tpp))


def problems(d: Design) -> list[str]:
    """What keeps the design from identifying L(N, D), or from fitting its budget; each says
    which knob to turn. Empty: the design may run."""
    return (_size_problems(d) + _multiple_problems(d) + _backtest_problems(d)
            + _budget_problems(d))


def _backtest_problems(d: Design) -> list[str]:
    """A held-out run further above the ladder than the ladder can test on itself."""
    can = d.backtest_ratio
    if d.ratio <= can * (1 + 1e-9):
        return []
    return [f"the held-out run at {d.ratio:g}x the largest rung cannot be backtested: the "
            f"fitted runs allow a backtest up to {can:.3g}x (L(N, D) needs 6+ runs of 2+ sizes "
            f"and 2+ tokens/param at or under 1/{d.ratio:g} of the largest compute); add rungs "
            f"that low (smaller widths, lower multiples with enough steps) or a --ratio of at "
            f"most {can:.3g}"]


def _size_problems(d: Design) -> list[str]:
    out = []
    if len(d.sizes) < 3:
        out.append(f"{len(d.sizes)} size(s): L(N, D) needs at least 3 to identify the N term, "
                   f"and a ladder that predicts {MIN_SIZES} or more: add widths to --sizes")
    elif len(d.sizes) < MIN_SIZES:
        out.append(f"{len(d.sizes)} sizes: fewer than {MIN_SIZES}, too few to check the fit by "
                   "leaving one size out: add widths to --sizes")
    if len(d.sizes) >= 2 and d.span < MIN_SPAN:
        out.append(f"the sizes span {d.span:.1f}x in non-embedding parameters, less than "
                   f"{MIN_SPAN:g}x: the N term is hardly seen; widen --sizes (smallest "
                   f"{min(s.width for s in d.sizes)}, largest {d.largest.width})")
    narrow = [s.width for s in d.sizes if s.head_width < MIN_HEAD_WIDTH]
    if narrow:
        out.append(f"width(s) {narrow} have heads narrower than {MIN_HEAD_WIDTH}: attention "
                   "that narrow does not work as it does in the target; fewer heads "
                   "(model.n_head) or wider sizes")
    heavy = [f"{s.width} ({s.embedding_fraction:.0%})" for s in d.sizes
             if s.embedding_fraction > MAX_EMBEDDING]
    if heavy:
        out.append(f"the embedding is more than {MAX_EMBEDDING:.0%} of the parameters at width(s) "
                   f"{', '.join(heavy)}: the rungs' bodies must hold the parameters; a smaller "
                   "vocabulary (data.tokenizer_vocab_size, 257 = bytes) or deeper rungs")
    return out


def _multiple_problems(d: Design) -> list[str]:
    out = []
    if len(d.multiples) < MIN_MULTIPLES:
        out.append(f"{len(d.multiples)} token multiple(s) per size ({_list(d.multiples)}): at "
                   f"least {MIN_MULTIPLES} separate the D term from the N term; add branch points "
                   "(checkpoint.branch_tokens_per_param)")
    short = d.short_runs()
    long = {r.tokens_per_param for r in d.runs if r not in short}
    if len(d.multiples) >= MIN_MULTIPLES and len(long) < MIN_MULTIPLES:
        out.append(f"only {len(long)} multiple(s) have runs of at least {d.min_steps} steps "
                   "(the rest are in their warm-up transient and left out of the fit): raise the "
                   "multiples (budget.tokens_per_param, checkpoint.branch_tokens_per_param) or "
                   "a smaller global batch")
    lo, hi = min(d.multiples), max(d.multiples)
    if hi < d.target_tpp:
        out.append(f"every rung is data-limited: the runs stop at {hi:g} tokens/param, the "
                   f"held-out run trains at {d.target_tpp:.3g}, so the fit sees the data term "
                   f"only; raise budget.tokens_per_param to at least {math.ceil(d.target_tpp)} "
                   "(fewer or smaller sizes keep the compute)")
    if not lo <= d.target_tpp <= hi:
        out.append(f"the held-out run's {d.target_tpp:.3g} tokens/param is outside the "
                   f"multiples' span [{lo:g}, {hi:g}]: move the branch points "
                   "(checkpoint.branch_tokens_per_param) or budget.tokens_per_param to bracket it")
    return out


def _budget_problems(d: Design) -> list[str]:
    out = []
    over = {k: v for k, v in d.epochs(d.heldout_tokens).items() if v >= 1.0}
    if over:
        out.append("the held-out run repeats data: " + ", ".join(
            f"{k} {v:.2f} epochs" for k, v in over.items())
            + "; a larger corpus, a smaller share of that source, or a lower --ratio")
    core = d.study_core_seconds
    if d.budget_seconds is not None and core is not None and core > d.budget_seconds:
        out.append(f"the study needs {core / 3600:.2f} core-hours (ladder "
                   f"{d.ladder_core_seconds / 3600:.2f}, held-out {d.heldout_seconds / 3600:.2f} "
                   f"x {d.heldout_threads} threads), more than the budget's "
                   f"{d.budget_seconds / 3600:.2f}: a lower --ratio, a smaller largest size, or "
                   "a lower top multiple")
    if d.budget_flops is not None and d.study_flops > d.budget_flops:
        out.append(f"the study needs {d.study_flops:.3g} FLOPs (C = 6 N D), more than "
                   f"--flops {d.budget_flops:.3g}: a lower --ratio or a smaller largest size")
    return out


def _list(xs) -> str:
    return ", ".join(f"{x:g}" for x in xs)


def _sec(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s:,.0f} s" if s < 120 else f"{s / 60:,.1f} min"


def _run_lines(d: Design) -> list[str]:
    lines = [f"  {'width':>5} {'seed':>6} {'tok/param':>9} {'tokens':>11} {'C=6ND':>9} "
             f"{'run':>7} {'expected':>9}"]
    for r in d.runs:
        seed = "recipe" if r.seed is None else str(r.seed)
        kind = "branch" if r.branch else "source"
        lines.append(f"  {r.width:>5} {seed:>6} {r.tokens_per_param:>9g} {r.tokens:>11,} "
                     f"{r.compute:>9.3g} {kind:>7} {_sec(r.seconds):>9}")
    return lines


def _size_lines(d: Design) -> list[str]:
    lines = [f"  {'width':>5} {'layers':>6} {'heads':>5} {'head':>4} {'N':>9} {'N non-emb':>9} "
             f"{'emb':>4} {'FLOPs/tok':>10} {'lr':>8} {'tok/s':>8}"]
    for s in d.sizes:
        rate = f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "?"
        lines.append(f"  {s.width:>5} {s.n_layer:>6} {s.n_head:>5} {s.head_width:>4} "
                     f"{s.n_params:>9,} {s.n_params_non_embedding:>9,} "
                     f"{s.embedding_fraction:>4.0%} {s.flops_per_token:>10,} {s.lr:>8.3g} "
                     f"{rate:>8}")
    if len({d.batch_of(s.width) for s in d.sizes}) > 1:
        lines.append("  batch per size (tokens): " + ", ".join(
            f"{s.width}: {d.batch_of(s.width):,}" for s in d.sizes))
    return lines


def render(d: Design, recipe: str, parametrization: str) -> str:
    """The plan as text: the rule, the sizes, the runs, the held-out run, the totals."""
    s0 = d.sizes[0]
    lines = [f"ladder design: recipe {recipe}, {len(d.sizes)} sizes, {d.span:.1f}x in "
             "non-embedding parameters",
             f"  rule: {s0.n_layer} layers, heads at least {min(s.head_width for s in d.sizes)} "
             f"wide, width = model.d_model; {parametrization}",
             f"  multiples: {_list(d.multiples)} tokens/param (WSD source runs to "
             f"{d.multiples[-1]:g}, cooldown branches at {_list(d.multiples[:-1])}, each decaying "
             f"over its last {d.decay_fraction:.0%}); batch {d.batch_tokens:,} tokens",
             "", *_size_lines(d), "", *_run_lines(d)]
    short = d.short_runs()
    if short:
        lines.append(f"  left out of the fit (fewer than {d.min_steps} steps, still in the warm-up "
                     "transient): " + ", ".join(f"width {r.width} at {r.tokens_per_param:g}"
                                                for r in short if r.seed is None))
    ladder_core, ladder_wall = d.ladder_core_seconds, d.ladder_wall_seconds
    lines += ["",
              f"  ladder: {len(d.runs)} runs ({len(d.seed_widths)} size(s) with a second seed: "
              f"{_list(d.seed_widths) or 'none'}), largest compute {d.largest_compute:.3g} "
              f"FLOPs, {_sec(ladder_core)} of one core, {_sec(ladder_wall)} of wall in "
              f"{d.jobs} stream(s)",
              f"  backtest: the fitted runs allow one up to {d.backtest_ratio:.3g}x (fit below "
              f"C_max / R, predict the top rungs; tools/scaling_law.py --backtest R); the "
              f"held-out run is at {d.ratio:g}x"]
    h = d.heldout
    lines += [f"  held-out: C = {d.ratio:g} x {d.largest_compute:.3g} = {d.heldout_compute:.3g} "
              f"FLOPs at {d.target_tpp:.3g} tokens/param ({d.target_tpp_from}): width {h.width} "
              f"({h.n_head} heads), N {h.n_params:,} ({h.n_params_non_embedding:,} non-emb, "
              f"{h.n_params_non_embedding / d.largest.n_params_non_embedding:.1f}x the largest "
              f"rung's), {d.heldout_tokens:,} tokens, {_sec(d.heldout_seconds)} at "
              f"{d.heldout_threads} thread(s)"
              + (f" ({h.tokens_per_s:,.0f} tok/s measured)" if h.tokens_per_s else "")]
    if d.sources:
        def ep(tokens):
            return ", ".join(f"{k} {v:.3f}" for k, v in d.epochs(tokens).items())
        top = max(d.runs, key=lambda r: r.tokens)
        lines.append(f"  epochs of each source: the longest rung {ep(top.tokens)}; "
                     f"the held-out run {ep(d.heldout_tokens)}")
    core = d.study_core_seconds
    total = (f"  study: {core / 3600:.2f} core-hours" if core is not None
             else "  study: ? core-hours (speeds not measured)")
    total += f", {d.study_flops:.3g} FLOPs (C = 6 N D)"
    if d.budget_seconds is not None:
        total += f", budget {d.budget_seconds / 3600:.2f} core-hours"
    if d.budget_flops is not None:
        total += f", budget {d.budget_flops:.3g} FLOPs"
    lines.append(total)
    return "\n".join(lines)
