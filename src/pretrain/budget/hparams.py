"""Learning rate and batch size from the compute budget: the power laws a run applies
(published, or fitted to a user's own sweep by analysis/hparam_fit.py).

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

Both laws were fitted on AdamW runs. Which optimizer may use which LR rule is
each optimizer's spec (``optim/specs.py`` lr_rules; decision/checks.py refuses the rest, saying
why): Muon keeps deepseek (its
``match_rms_adamw`` update has AdamW's RMS, so AdamW's LR is its LR); LAMB and LARS, whose
steps are fractions of each weight's norm, take fixed or power (a fit of their own runs).
The batch rule is left to every optimizer: the batch a run can use is set by the noise of
the gradient (McCandlish et al. 2018), more than by the optimizer that follows it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pretrain.budget.compute import BudgetError, rule_tokens
from pretrain.config.schema import Config, ModelConfig
from pretrain.model.gpt import ffn_dim
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
