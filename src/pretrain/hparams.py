"""Learning rate and batch size from the compute budget: published power laws, and their fit
to a user's own sweep.

DeepSeek LLM (Bi et al. 2024, arXiv 2401.02954, section 3.1) fitted, over a grid of batch
sizes and learning rates at budgets of 1e17 to 2e19 FLOPs:

    lr_opt    = 0.3118 * C^-0.1250
    batch_opt = 0.2920 * C^0.3271      (tokens)

with C = M * D in the paper's convention (section 3.2): D tokens and M the
*non-embedding* FLOPs per token, M = 72 n_layer d_model^2 + 12 n_layer d_model l_seq (the
block matrices, 6 x 12 d^2 per layer, plus the attention scores and values, 12 d l_seq per
layer, no causal discount; neither the embedding nor the output head counts). This is not
the project's own FLOP count (``budget.flops_per_token``, PaLM's, which counts the output
head) nor 6ND (``budget=flops`` and ``tools/scaling_law.py``): the rules convert, computing
M from the model config (``deepseek_flops_per_token``), and ``plan["hparam_compute"]`` is
that C. For GPT-style blocks (d_ff = 4 d, as many key/value heads as heads) the count below
is exactly the paper's formula; for other shapes (SwiGLU, GQA) it counts the block's actual
matrices, which is what the formula stands for.

A rule resolves before anything else (``apply_rules``): the batch, in tokens, becomes
sequences of ``model.seq_len`` rounded to a multiple of micro_batch_size x dp (x pp when
pipelined, so that every pipeline gets whole rounds), which fixes the accumulation count;
the token budget D does not change (only its number of steps), so C does not depend on the
batch, except for ``budget.kind=steps``, where D = steps x batch and a batch rule is
circular (refused).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pretrain.budget import BudgetError, rule_tokens
from pretrain.config import Config, ModelConfig
from pretrain.model import ffn_dim
from pretrain.parallel.layout import derived_dp


@dataclass(frozen=True)
class PowerLaw:
    """y = coef * C^exponent."""

    coef: float
    exponent: float

    def __call__(self, compute: float) -> float:
        return self.coef * compute ** self.exponent

    def __str__(self) -> str:
        return f"{self.coef:.4g} C^{self.exponent:+.4f}"


@dataclass(frozen=True)
class HparamLaws:
    lr: PowerLaw
    batch_tokens: PowerLaw
    source: str


# Section 3.1 of arXiv 2401.02954 (eq. 1), C in non-embedding FLOPs (M x D).
DEEPSEEK = HparamLaws(lr=PowerLaw(0.3118, -0.1250), batch_tokens=PowerLaw(0.2920, 0.3271),
                      source="DeepSeek LLM (Bi et al. 2024, arXiv 2401.02954, sec. 3.1)")


def deepseek_flops_per_token(model: ModelConfig) -> int:
    """M, DeepSeek's non-embedding training FLOPs per token: 6 x the block matrices' weights
    (72 n_layer d_model^2 for a GPT block) + 12 n_layer d_model l_seq (attention)."""
    d, head = model.d_model, model.d_model // model.n_head
    kv = (model.n_kv_head or model.n_head) * head
    attn = d * d + 2 * d * kv + d * d  # q, k and v, output projection
    mlp = (3 if model.mlp == "swiglu" else 2) * d * ffn_dim(model)
    return 6 * model.n_layer * (attn + mlp) + 12 * model.n_layer * d * model.seq_len


def hparam_compute(cfg: Config) -> tuple[float, int, int]:
    """(C = M x D, M, D) of a run, in DeepSeek's convention; D is the budget rule's tokens
    (before rounding up to whole steps, so every batch of a sweep point gets the same C)."""
    m = deepseek_flops_per_token(cfg.model)
    d, _ = rule_tokens(cfg.model, cfg.budget, cfg.train.global_batch_size)
    return float(m) * d, m, d


def _law(kind: str, rule: str, law: Sequence[float] | None, published: PowerLaw) -> PowerLaw:
    if rule == "deepseek":
        return published
    if law is None or len(law) != 2:
        key = "optim.lr_law" if kind == "lr" else "train.batch_law"
        raise BudgetError(f"{kind} rule 'power' needs {key}=[coef,exponent] (tools/"
                          "scaling_law.py --hparams prints the line for your sweep)")
    return PowerLaw(float(law[0]), float(law[1]))


def batch_multiple(cfg: Config, world_size: int) -> int:
    """Sequences the global batch must be a multiple of for this layout: micro batch x dp,
    x pp when pipelined (whole rounds of microbatches for every pipeline schedule)."""
    par = cfg.parallel
    dp = max(derived_dp(cfg, world_size), 1)
    return max(par.micro_batch_size, 1) * dp * (par.pp if par.pp > 1 else 1)


def round_batch(tokens: float, seq_len: int, multiple: int) -> int:
    """Sequences nearest ``tokens`` (in log scale: the rules are power laws) that are a
    positive multiple of ``multiple``."""
    seqs = tokens / seq_len
    lo = max(multiple, math.floor(seqs / multiple) * multiple)
    hi = lo + multiple
    return lo if seqs <= lo or math.log(seqs / lo) <= math.log(hi / seqs) else hi


def apply_rules(cfg: Config, world_size: int) -> tuple[Config, dict]:
    """``cfg`` with optim.lr and train.global_batch_size from their rules (unchanged when
    both are ``fixed``), and what was decided, for the plan. Deterministic: every rank
    resolves the same values."""
    lr_rule, batch_rule = cfg.optim.lr_rule, cfg.train.batch_rule
    if lr_rule == "fixed" and batch_rule == "fixed":
        return cfg, {}
    if batch_rule != "fixed" and cfg.budget.kind == "steps":
        raise BudgetError("train.batch_rule needs a token budget: with budget.kind=steps the "
                          "tokens D (and so C) depend on the batch the rule is to give; use "
                          "budget=tokens, chinchilla or flops")
    c, m, d = hparam_compute(cfg)
    info: dict = {"compute": c, "flops_per_token": m, "tokens": d,
                  "convention": "C = M x D, M = DeepSeek non-embedding FLOPs/token "
                                "(72 n_layer d^2 + 12 n_layer d l_seq for a GPT block)"}
    if batch_rule != "fixed":
        law = _law("batch", batch_rule, cfg.train.batch_law, DEEPSEEK.batch_tokens)
        raw = law(c)
        multiple = batch_multiple(cfg, world_size)
        gbs = round_batch(raw, cfg.model.seq_len, multiple)
        info["batch"] = {"rule": f"{batch_rule}: {law} tokens", "tokens_raw": raw,
                         "sequences_raw": raw / cfg.model.seq_len, "multiple": multiple,
                         "global_batch_size": gbs,
                         "tokens": gbs * cfg.model.seq_len,
                         "was": cfg.train.global_batch_size}
        cfg = replace(cfg, train=replace(cfg.train, global_batch_size=gbs))
    if lr_rule != "fixed":
        law = _law("lr", lr_rule, cfg.optim.lr_law, DEEPSEEK.lr)
        lr = law(c)
        info["lr"] = {"rule": f"{lr_rule}: {law}", "lr": lr, "was": cfg.optim.lr}
        if cfg.optim.lr_scaling != "none":
            info["lr"]["note"] = (f"optim.lr_scaling={cfg.optim.lr_scaling} not applied: the "
                                  "rule's LR is already the LR for this run's batch")
        cfg = replace(cfg, optim=replace(cfg.optim, lr=lr))
    return cfg, info


def describe(info: dict) -> str:
    """One line for the log: C and what each rule gave."""
    parts = [f"C = M x D = {info['flops_per_token']:,} x {info['tokens']:,} = "
             f"{info['compute']:.4g} (DeepSeek non-embedding FLOPs)"]
    if "lr" in info:
        parts.append(f"lr {info['lr']['lr']:.4g} from {info['lr']['rule']}"
                     + (f" ({info['lr']['note']})" if "note" in info["lr"] else ""))
    if "batch" in info:
        b = info["batch"]
        parts.append(f"batch {b['tokens_raw']:,.0f} tokens ({b['sequences_raw']:.1f} sequences)"
                     f" from {b['rule']} -> {b['global_batch_size']} sequences = "
                     f"{b['tokens']:,} tokens (a multiple of {b['multiple']})")
    return "hyperparameter rules: " + "; ".join(parts)


# -- fitting the laws to a sweep ------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    compute: float  # C = M x D
    lr: float
    batch_tokens: float
    loss: float
    name: str = ""


@dataclass(frozen=True)
class BudgetOptimum:
    compute: float
    lr: float
    batch_tokens: float
    loss: float
    how: str  # "quadratic" (smoothed) or "grid" (the best run)
    runs: int
    # "lr" / "batch" when the optimum is the grid's smallest or largest value of that axis:
    # the true optimum may lie outside the grid
    edges: tuple[str, ...] = ()


def collect_sweep(root: Path | str) -> list[SweepPoint]:
    """Every finished run under ``root`` (``result.json`` with a finite final validation
    loss, ``plan.json`` beside it): its C (the plan's ``hparam_compute``), peak LR, global
    batch in tokens and loss."""
    from pretrain.scaling import finished_runs

    points = []
    for run_dir, plan, result in finished_runs(root):
        if "hparam_compute" not in plan:
            continue  # written before plans recorded C
        loss = result["final_val_loss"]
        points.append(SweepPoint(compute=float(plan["hparam_compute"]), lr=float(plan["lr"]),
                                 batch_tokens=float(plan["global_batch_tokens"]),
                                 loss=float(loss), name=str(run_dir.name)))
    return points


def group_by_compute(points: Iterable[SweepPoint], rel: float = 1e-3) -> list[list[SweepPoint]]:
    groups: list[list[SweepPoint]] = []
    for p in sorted(points, key=lambda p: p.compute):
        if groups and abs(p.compute / groups[-1][0].compute - 1) <= rel:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def best_of_budget(points: Sequence[SweepPoint]) -> BudgetOptimum:
    """The optimum of one budget's grid: the minimum of a quadratic in (log lr, log batch)
    fitted by least squares to the runs (a smoothed best-of-grid: grid noise moves it less
    than it moves the argmin), kept when the quadratic is convex and its minimum lies inside
    the grid's range; else the best run. An axis with fewer than 3 values is left out of the
    quadratic."""
    pts = [p for p in points if math.isfinite(p.loss)]
    if not pts:
        raise ValueError("no finite loss in this budget")
    best = min(pts, key=lambda p: p.loss)
    edges = tuple(name for name, v, vals in (
        ("lr", best.lr, [p.lr for p in pts]),
        ("batch", best.batch_tokens, [p.batch_tokens for p in pts]))
        if len(set(vals)) > 1 and v in (min(vals), max(vals)))
    grid = BudgetOptimum(best.compute, best.lr, best.batch_tokens, best.loss, "grid", len(pts),
                         edges)
    x = np.log([p.lr for p in pts])
    y = np.log([p.batch_tokens for p in pts])
    z = np.array([p.loss for p in pts])
    axes = [a for a in (x, y) if len(np.unique(np.round(a, 9))) >= 3]
    if not axes:
        return grid
    cols = [np.ones_like(z)] + axes + [a * a for a in axes]
    if len(axes) == 2:
        cols.append(axes[0] * axes[1])
    design = np.stack(cols, axis=1)
    if len(z) <= design.shape[1]:
        return grid
    coef, *_ = np.linalg.lstsq(design, z, rcond=None)
    k = len(axes)
    g = coef[1:1 + k]
    h = np.diag(2 * coef[1 + k:1 + 2 * k])
    if k == 2:
        h[0, 1] = h[1, 0] = coef[-1]
    if np.any(np.linalg.eigvalsh(h) <= 0):
        return grid
    opt = np.linalg.solve(h, -g)
    for a, o in zip(axes, opt, strict=True):
        if not a.min() <= o <= a.max():  # no extrapolation beyond the grid
            return grid
    values = {id(x): best.lr, id(y): best.batch_tokens}
    for a, o in zip(axes, opt, strict=True):
        values[id(a)] = float(math.exp(o))
    loss = float(coef[0] + g @ opt + 0.5 * opt @ h @ opt)
    return BudgetOptimum(best.compute, values[id(x)], values[id(y)], loss, "quadratic",
                         len(pts))  # an interior minimum: no edge


def fit_power_law(compute: Sequence[float], values: Sequence[float]) -> PowerLaw:
    """Least squares of log value on log C: value = coef * C^exponent."""
    if len(compute) < 2 or len(set(compute)) < 2:
        raise ValueError("a power law needs optima at 2 or more compute budgets")
    b, a = np.polyfit(np.log(compute), np.log(values), 1)
    return PowerLaw(float(math.exp(a)), float(b))


def fit_hparam_laws(points: Iterable[SweepPoint]) -> tuple[HparamLaws, list[BudgetOptimum]]:
    """The optimum of every budget (``best_of_budget``), then lr(C) and batch(C)."""
    optima = [best_of_budget(g) for g in group_by_compute(points)]
    c = [o.compute for o in optima]
    laws = HparamLaws(lr=fit_power_law(c, [o.lr for o in optima]),
                      batch_tokens=fit_power_law(c, [o.batch_tokens for o in optima]),
                      source=f"fitted to {len(optima)} budgets")
    return laws, optima


def override_line(laws: HparamLaws) -> str:
    """The command-line overrides that make a recipe use these laws."""
    return (f"optim.lr_rule=power 'optim.lr_law=[{laws.lr.coef:.6g},{laws.lr.exponent:.6g}]' "
            f"train.batch_rule=power 'train.batch_law=[{laws.batch_tokens.coef:.6g},"
            f"{laws.batch_tokens.exponent:.6g}]'")
