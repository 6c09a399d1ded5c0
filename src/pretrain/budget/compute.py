"""Parameter and FLOP counts, and the token budget a scaling rule gives.

Conventions (stated once, used everywhere: plan, logs, MFU, scaling-law fits):

- ``n_params``: every trainable parameter, counted once (tied matrices once), without the
  rows that pad the vocabulary to ``model.pad_vocab_to`` (they are never a target and carry
  no signal); those are ``n_params_padding``, said apart in the plan and the log. For GPT-2
  this is the published count of the released checkpoints (124,439,808 for gpt2-124m,
  whose 50,304 padded rows add 36,096 more).
- ``n_params_non_embedding``: minus the token and position embedding tables (Kaplan et al.
  2020). With tied embeddings the output matrix is the embedding table and is excluded too.
- ``flops_per_token``: training FLOPs per token, 6 * N_matmul + 12 * L * d_attn * T
  (PaLM, Chowdhery et al. 2022, appendix B): N_matmul counts the parameters that take part in
  matrix multiplies (everything except the position table and an untied input embedding,
  whose lookups cost nothing; the output head counts whether tied or not, padded rows
  included: the GEMM computes them), and the second
  term is the attention scores and values (forward + backward, no causal discount).
- ``n_params_active``: the parameters one token uses. A mixture of experts counts its
  ``moe_top_k`` routed experts of ``moe_experts`` (plus router and shared experts); for a
  dense model it is ``n_params``. Mixtral 8x7B: 46.7B total, 12.9B active.
- Scaling rules use N = n_params_active (Hoffmann et al. 2022; n_params for a dense model)
  unless ``budget.param_count`` is ``non_embedding`` (Kaplan et al.; active too), and
  compute C = 6 * N * D (``run_compute``; a run's ``compute`` is that C with N =
  n_params_active, the C the scaling-law fits use). ``flops_per_token`` counts the active
  matmuls likewise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from pretrain.config.schema import BudgetConfig, ModelConfig
from pretrain.errors import UserError
from pretrain.model.gpt import GPT
from pretrain.model.moe import moe_layers

# C = 6 N D: about 6 FLOPs per parameter and token for a forward and backward pass (Kaplan et
# al. 2020, section 2.1; Hoffmann et al. 2022). The one definition of a run's compute: the
# scaling-law fits (analysis/scaling.py), their predictions, the compute-optimal split,
# ``budget.kind=flops`` and the plan's ``compute`` all use it. The plan's ``total_flops``
# (PaLM's count, attention included) is the hardware work for time and MFU, a different
# number; DeepSeek's M x D (``hparams.hparam_compute``) is a third, kept for its published
# constants.
FLOPS_PER_PARAM_TOKEN = 6


def run_compute(n_params: float, tokens: float) -> float:
    """C = 6 N D of a run of ``n_params`` parameters (the active ones, as ``plan.json``'s
    ``n_params_active``; all of them for a dense model) trained on ``tokens`` tokens."""
    return float(FLOPS_PER_PARAM_TOKEN) * n_params * tokens


def compute_tokens(flops: float, n_params: float) -> int:
    """The tokens D that a compute budget C buys a model of N parameters: C / (6 N),
    rounded up (``budget.kind=flops``)."""
    return math.ceil(flops / (FLOPS_PER_PARAM_TOKEN * n_params))


@dataclass(frozen=True)
class ParamCounts:
    total: int  # without the vocabulary padding
    non_embedding: int
    matmul: int  # those one token multiplies by, padding included (hardware work)
    padding: int = 0  # parameters in the padded vocabulary rows (embedding, untied head)
    inactive: int = 0  # routed experts' parameters a token does not use (MoE)

    @property
    def active(self) -> int:
        return self.total - self.inactive

    @property
    def non_embedding_active(self) -> int:
        return self.non_embedding - self.inactive


def count_params(cfg: ModelConfig) -> ParamCounts:
    """Exact counts, from the module itself built on the meta device (no memory used)."""
    with torch.device("meta"):
        model = GPT(cfg)
    stored = sum(p.numel() for p in model.parameters())
    tok = model.tok_emb.weight.numel()
    pos = model.pos_emb.weight.numel() if model.pos_emb is not None else 0
    pad_rows = model.tok_emb.weight.shape[0] - cfg.vocab_size
    padding = pad_rows * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    non_embedding = stored - tok - pos - (0 if cfg.tie_embeddings else padding // 2)
    inactive = sum(sum(p.numel() for p in moe.experts.parameters())
                   * (moe.n_experts - moe.top_k) // moe.n_experts for _, moe in moe_layers(model))
    matmul = stored - pos - (0 if cfg.tie_embeddings else tok) - inactive
    return ParamCounts(total=stored - padding, non_embedding=non_embedding, matmul=matmul,
                       padding=padding, inactive=inactive)


def flops_per_token(cfg: ModelConfig, counts: ParamCounts | None = None) -> int:
    counts = counts or count_params(cfg)
    d_attn = (cfg.d_model // cfg.n_head) * cfg.n_head
    return 6 * counts.matmul + 12 * cfg.n_layer * d_attn * cfg.seq_len


@dataclass(frozen=True)
class Budget:
    n_params: int
    n_params_non_embedding: int
    n_params_active: int  # per token: n_params for a dense model, k of E experts for MoE
    n_params_padding: int  # padded vocabulary rows, stored and computed, not in n_params
    tokens: int
    steps: int
    global_batch_tokens: int
    flops_per_token: int
    total_flops: float  # hardware work (flops_per_token x tokens): time, MFU
    compute: float  # C = 6 N D (run_compute): what the scaling laws call compute
    rule: str

    def as_dict(self) -> dict:
        return asdict(self)


class BudgetError(UserError, ValueError):
    pass


def rule_tokens(model: ModelConfig, budget: BudgetConfig, global_batch_size: int,
                counts: ParamCounts | None = None) -> tuple[int, str]:
    """Tokens D the budget rule asks for (before rounding up to whole steps), and the rule
    in words."""
    counts = counts or count_params(model)
    n = (counts.non_embedding_active if budget.param_count == "non_embedding"
         else counts.active)
    batch_tokens = global_batch_size * model.seq_len
    kind = budget.kind
    if kind == "tokens":
        if not budget.tokens or budget.tokens <= 0:
            raise BudgetError("budget.kind=tokens needs budget.tokens > 0 (e.g. budget.tokens=1e9)")
        return int(budget.tokens), f"fixed {int(budget.tokens):,} tokens"
    if kind == "tokens_per_param":
        if budget.tokens_per_param <= 0:
            raise BudgetError("budget.tokens_per_param must be > 0 (Chinchilla: 20)")
        return (math.ceil(budget.tokens_per_param * n),
                f"{budget.tokens_per_param:g} tokens/param x N={n:,}")
    if kind == "flops":
        if not budget.flops or budget.flops <= 0:
            raise BudgetError("budget.kind=flops needs budget.flops > 0 (e.g. budget.flops=1e20)")
        return compute_tokens(budget.flops, n), f"C={budget.flops:.3g} FLOPs / (6 N={n:,})"
    # steps, the last of budget.kind's values
    if not budget.steps or budget.steps <= 0:
        raise BudgetError("budget.kind=steps needs budget.steps > 0")
    return budget.steps * batch_tokens, f"fixed {budget.steps} steps"


def resolve_budget(model: ModelConfig, budget: BudgetConfig, global_batch_size: int) -> Budget:
    """Tokens D from the rule, then steps = ceil(D / tokens per global batch)."""
    counts = count_params(model)
    batch_tokens = global_batch_size * model.seq_len
    tokens, rule = rule_tokens(model, budget, global_batch_size, counts)
    steps = max(1, math.ceil(tokens / batch_tokens))
    fpt = flops_per_token(model, counts)
    return Budget(
        n_params=counts.total,
        n_params_non_embedding=counts.non_embedding,
        n_params_active=counts.active,
        n_params_padding=counts.padding,
        tokens=steps * batch_tokens,
        steps=steps,
        global_batch_tokens=batch_tokens,
        flops_per_token=fpt,
        total_flops=float(fpt) * steps * batch_tokens,
        compute=run_compute(counts.active, steps * batch_tokens),
        rule=rule,
    )
