"""How a model's numbers scale with its width and depth: ``model.parametrization``.

- ``sp``, the standard parametrisation: every rule below is the identity (GPT-2's init, one
  LR for every parameter, 1/sqrt(d_head) attention). The best LR drifts with width.
- ``mup``, the maximal update parametrisation (Yang et al. 2022, Tensor Programs V, Table 3
  with Adam; the layout of EleutherAI's nanoGPT-mup and of the ``mup`` package's MuReadout):
  with ``m = d_model / model.base_width``, the hidden matrices (attention and MLP/expert
  projections, both dimensions growing with width) start at ``init_std / sqrt(m)`` and take
  AdamW's LR and epsilon divided by ``m``; embeddings, norms, biases, an untied output head
  and MoE routers (one dimension fixed: "vector-like") keep ``init_std`` and the LR; the
  logits are multiplied by ``model.output_mult / m`` (the output multiplier, which makes
  a tied head vector-like too; ``output_mult``, the ``mup`` package's, is the base's, tuned
  there like its LR); attention scores are ``q.k sqrt(d_head_base) / d_head`` (1/d_head, as
  muP needs, with the base width's sp scale kept: the ``mup`` package's ``attn_mult``,
  Cerebras muGPT) instead of ``/ sqrt(d_head)``; every AdamW epsilon is divided by ``m``
  and the hidden weight decay multiplied by ``m`` (AdamW's per-step decay ``lr x decay``
  stays the base's: the ``mup`` package's MuAdamW, whose decay is coupled to the LR as
  torch's AdamW's is). At ``d_model = base_width`` with ``output_mult = 1`` it is ``sp``,
  bit for bit.
- ``completep`` (Dey et al. 2025, arXiv 2505.01618, alpha = 1): ``mup`` plus, with
  ``L = n_layer / model.base_depth``, every residual branch multiplied by ``1 / L``
  (attention and MLP outputs before they join the residual stream), residual projections
  initialised at base depth's GPT-2 scale (``init_std / sqrt(2 base_depth)``: the branch
  multiplier, not the init, takes care of depth) and the hidden epsilon divided by ``m L``.
  The depth LR correction is ``L^(alpha - 1) = 1``.

Deviation from the reference implementation, for one reason: every rank's optimizer keeps
exactly two parameter groups (hidden matrices; everything else), as ``sp`` does, so that
checkpoints and pipeline stages line up group by group. Hence under mup/completep the
vector-like matrices (an untied head, MoE routers) join the no-decay group (an embedding
already does), and the hidden norms and biases share the embeddings' epsilon.

Optimizers: AdamW as above; Muon (with AdamW for the rest) takes the same rule, since
``match_rms_adamw`` gives Muon's updates AdamW's RMS: its matrices' LR is divided by ``m``
and its AdamW part follows the AdamW rule. LAMB and LARS are refused: their trust ratio
already sets each tensor's step relative to its norm, and no muP rule for it is published
that this project could test against.

All multipliers are plain Python floats the model is constructed with (no parameters, no
parallelism): the planner's counts do not change, and HF export folds them into weights
(``fold_into_weights``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.config.schema import ModelConfig

PARAMETRIZATIONS = ("sp", "mup", "completep")
# Hidden matrices: both dimensions grow with the width (attention, MLP and experts' weights).
HIDDEN = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight",
          "mlp.w1.weight", "mlp.w2.weight", "mlp.w3.weight", "shared.w1.weight",
          "shared.w2.weight", "shared.w3.weight", "experts.w1", "experts.w2", "experts.w3")
# The matrices that write into the residual stream (GPT-2's scaled init; CompleteP's branch).
RESIDUAL_OUT = ("attn.wo", "mlp.w2", "shared.w2", "experts.w2")


@dataclass(frozen=True)
class Scales:
    """One model's multipliers. ``width`` = d_model / base_width, ``depth`` = n_layer /
    base_depth (1 unless completep)."""

    kind: str
    width: float = 1.0
    depth: float = 1.0
    output_mult: float = 1.0  # the base's logit multiplier (model.output_mult)

    @property
    def active(self) -> bool:
        return self.kind != "sp"

    @property
    def output(self) -> float:
        """Multiplier of the logits: the base's ``output_mult``, divided by the width."""
        return self.output_mult / self.width

    @property
    def residual(self) -> float:
        """Multiplier of every residual branch (CompleteP's 1/L, alpha = 1)."""
        return 1.0 / self.depth

    @property
    def hidden_lr(self) -> float:
        """Factor of the hidden matrices' AdamW (and Muon) LR."""
        return 1.0 / self.width

    @property
    def hidden_eps(self) -> float:
        return 1.0 / (self.width * self.depth)

    @property
    def other_eps(self) -> float:
        return 1.0 / self.width

    @property
    def hidden_decay(self) -> float:
        """Factor of the hidden weight decay: ``width``, so that AdamW's per-step decay
        lr x decay stays the base's while the LR is divided by the width (the ``mup``
        package's MuAdamW with its default coupled decay; CompleteP's reference)."""
        return self.width if self.active else 1.0


def scales(cfg: ModelConfig) -> Scales:
    """``cfg``'s multipliers (all 1 under sp)."""
    kind = str(cfg.parametrization)
    if kind == "sp":
        return Scales("sp")
    width = cfg.d_model / (cfg.base_width or cfg.d_model)
    depth = cfg.n_layer / (cfg.base_depth or cfg.n_layer) if kind == "completep" else 1.0
    return Scales(kind, width, depth, cfg.output_mult)


def attention_scale(cfg: ModelConfig) -> float | None:
    """The attention's softmax scale: None (the kernel's 1/sqrt(d_head)) under sp;
    sqrt(d_head_base) / d_head under mup and completep, 1/d_head times the base width's
    sp scale, so that the base model's scores are sp's (the ``mup`` package's attn_mult,
    Cerebras muGPT). d_head_base is base_width / n_head: the heads stay, their width grows."""
    if str(cfg.parametrization) == "sp":
        return None
    head = cfg.d_model // cfg.n_head
    base_head = (cfg.base_width or cfg.d_model) / cfg.n_head
    return math.sqrt(base_head) / head


def is_hidden(name: str) -> bool:
    """Whether parameter ``name`` (the model's own name) is a hidden matrix."""
    return name.endswith(HIDDEN)


def init_std(cfg: ModelConfig, name: str, module: str) -> float:
    """The normal init's std of matrix ``name`` (in ``module``): ``init_std`` for
    embeddings and vector-like matrices, divided by sqrt(width) for hidden ones under
    mup/completep; residual projections by sqrt(2 n_layer) (GPT-2), or sqrt(2 base_depth)
    under completep."""
    std = cfg.init_std
    s = scales(cfg)
    if s.active and is_hidden(name):
        std /= math.sqrt(s.width)
    if module.endswith(RESIDUAL_OUT[:3]) or name.endswith("experts.w2"):
        depth = (cfg.base_depth or cfg.n_layer) if s.kind == "completep" else cfg.n_layer
        std /= math.sqrt(2 * depth)
    return std


def problems(cfg: ModelConfig) -> list[str]:
    """What is wrong with ``model.parametrization`` and its bases in this config. A base
    that is no size, and an output_mult that is not positive, are refused under every
    parametrization (sp ignores them, but a sweep that shares the recipe with mup would not).
    Whether the optimizer has a muP rule is its spec's (pretrain.optim.specs.mup_problems)."""
    out = []
    for key, size in (("base_width", "d_model"), ("base_depth", "n_layer")):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            out.append(f"model.{key}={value} must be positive: the {size} the "
                       f"hyperparameters were tuned at (or null: this model's own {size})")
    if not cfg.output_mult > 0:  # refused under sp too, as the bases are
        out.append(f"model.output_mult={cfg.output_mult} must be positive (1: the base's "
                   "logits unscaled)")
    return out


def describe(cfg: ModelConfig) -> dict:
    """What the plan states of the multipliers (nothing under sp). A model narrower than
    its base (m < 1) is allowed, as in the ``mup`` package and in Tensor Programs V's width
    sweeps, which span widths on both sides of the base: the rules are ratios and hold
    either way, but the hidden LR then rises above the tuned one, so the plan says so."""
    s = scales(cfg)
    if not s.active:
        return {}
    out = {"width_multiplier": s.width}
    if s.kind == "completep":
        out["depth_multiplier"] = s.depth
    if s.width < 1:
        out["width_note"] = (
            f"model.d_model={cfg.d_model} is narrower than model.base_width="
            f"{cfg.base_width} (m = {s.width:g}): muP extrapolates down from the tuned "
            f"width, the hidden matrices' LR is {1 / s.width:g}x the tuned one and the "
            f"logits {1 / s.width:g}x; set model.base_width to the width the hyperparameters "
            "were tuned at if this is not meant")
    return out


def fold_into_weights(cfg: ModelConfig, sd: dict, inverse: bool = False) -> dict:
    """A (full, unsharded) state dict whose plain-transformer forward (1/sqrt(d_head)
    attention, unit residual branches and logits) equals this model's, by exact algebra:
    the attention scale into the queries (q' = q x scale x sqrt(d_head): the q projection,
    or the q norm's gain under QK-norm; RoPE is linear), the residual multiplier into the
    matrices (and biases) that write each branch's output, the output multiplier into the
    final norm's gain and bias. ``inverse``: the other way (importing such weights)."""
    s = scales(cfg)
    if not s.active:
        return sd
    out = dict(sd)
    head_dim = cfg.d_model // cfg.n_head
    q_factor = attention_scale(cfg) * math.sqrt(head_dim)
    factors = {"norm.weight": s.output, "norm.bias": s.output}
    for i in range(cfg.n_layer):
        a, m = f"layers.{i}.attn.", f"layers.{i}."
        q = [a + "q_norm.weight"] if cfg.qk_norm else [a + "wq.weight", a + "wq.bias"]
        factors.update(dict.fromkeys(q, q_factor))
        outs = [a + "wo", m + "mlp.w2", m + "moe.shared.w2"]
        factors.update({f"{n}.{k}": s.residual for n in outs for k in ("weight", "bias")})
        factors[m + "moe.experts.w2"] = s.residual
    for name, f in factors.items():
        if name in out and f != 1.0:
            out[name] = out[name] / f if inverse else out[name] * f
    return out
