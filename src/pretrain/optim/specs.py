"""One spec per optimizer: everything the runtime, the checks and the planner know of it.

``OPTIMIZERS`` maps ``optim.name`` (conf/optim/<name>.yaml) to its ``OptimizerSpec``: how it
is built, which LR rules and batch scalings it takes and its usual LR range, the bytes of
state it keeps for one parameter, whether its step is elementwise (and so may run on the
host under ``parallel.offload=params``), and whether it has a muP/CompleteP rule. The
factory, the config checks, the layout rules and the memory planner read these fields; no
module outside this one compares an optimizer's name. Adding an optimizer is one entry here,
its YAML and its test (docs/adding-an-optimizer.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pretrain.config.schema import OptimConfig
from pretrain.optim.factory import (
    build_adamw,
    build_lamb,
    build_lars,
    build_muon,
    decay_groups,
    model_scales,
)
from pretrain.optim.muon import muon_matrix

# build(model, cfg, lr, device, also_embeddings) -> the optimizer
Build = Callable[[torch.nn.Module, OptimConfig, float, torch.device, list], torch.optim.Optimizer]
# state_bytes(name, shape, local_shape, pb): bytes of state for the parameter ``name`` of
# global ``shape`` of which this rank holds ``local_shape``, parameters ``pb`` bytes each
StateBytes = Callable[[str, tuple[int, ...], tuple[int, ...], int], int]
ANY_RULE = frozenset({"fixed", "deepseek", "power"})
ANY_SCALING = frozenset({"none", "sqrt", "linear"})


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer. ``lr_rules``/``lr_scalings``: the optim.lr_rule and optim.lr_scaling
    values that keep their meaning with it (``why``: the reason the others do not);
    ``lr_range``: the peak LRs it usually trains with (outside, the plan warns);
    ``elementwise``: its step reads each element alone (no whole-tensor norm, gather or
    factored reduction), so FSDP2 may run it on host shards; ``mup``: it has a
    muP/CompleteP rule (model/parametrization.py's groups); ``orthogonalises``: its step
    gathers and orthogonalises whole matrices (Muon: the planner's step transient);
    ``on_dtensor``: its step runs on DTensor parameters (FSDP2's and TP's shards), else the
    layout rules keep it to whole tensors (one process, or DDP's replicas)."""

    name: str
    build: Build
    state_bytes: StateBytes
    lr_range: tuple[float, float]
    lr_rules: frozenset[str] = ANY_RULE
    lr_scalings: frozenset[str] = ANY_SCALING
    why: str = ""
    elementwise: bool = False
    mup: bool = False
    orthogonalises: bool = False
    on_dtensor: bool = True


def _adam_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """torch's AdamW (and trust_ratio.Lamb, which keeps the same): two moments in the
    parameter dtype and a 4-byte step per tensor."""
    return 2 * pb * math.prod(local) + 4


def _momentum_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """LARS: one momentum buffer, no step counter."""
    return pb * math.prod(local)


def _muon_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """Muon's momentum on its matrices (``muon.muon_matrix``), AdamW's state on the rest."""
    if muon_matrix(name, shape):
        return pb * math.prod(local)
    return _adam_state(name, shape, local, pb)


def _factored_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """torch's Adafactor: a float32 step, and the second moment factored over the last two
    dimensions, a row and a column factor per leading index ((r + c) per r x c matrix, not
    r x c), or whole for a vector."""
    if len(local) < 2:
        return 4 + pb * math.prod(local)
    return 4 + pb * math.prod(local[:-2]) * (local[-2] + local[-1])


def _adafactor(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
               also_embeddings: list[torch.nn.Parameter]) -> torch.optim.Adafactor:
    """torch's Adafactor (Shazeer & Stern 2018; T5, PaLM), decay on the matrices only; its
    own epsilons, beta2 decay and update clipping (torch's defaults)."""
    decay, no_decay = decay_groups(model, also_embeddings)
    return torch.optim.Adafactor([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=lr, weight_decay=cfg.weight_decay)


# The peak LRs, generous on both sides, one LR is rarely right for two optimizers (AdamW's
# 3e-3 moves LARS's weights 1000x too little):
# - adamw: GPT-3's 0.6e-4 (175B) to 6e-4 (125M); tiny models to 1e-2 (README's sweeps).
# - muon: AdamW's (match_rms_adamw); llama-tiny's best was 8e-3 (README).
# - lamb: You et al. 2020's 1e-3 to 1.76e-2 (BERT); llama-tiny's best was 3.2e-2 (README).
# - lars: You et al. 2017's 1 to 29 (ResNet-50, eta 1e-3); llama-tiny's best was 4 (README).
# - adafactor: its step is min(lr, 1/sqrt(t)) x each tensor's RMS (relative step): torch's
#   default 1e-2 (T5's); above 1 the 1/sqrt(t) cap is all that acts.
# LR rules: deepseek's LR law was fitted on AdamW runs. Muon with match_rms_adamw gives its
# updates AdamW's RMS (Moonlight reuses AdamW's LR and decay unchanged), so the law carries
# over; LAMB and LARS step a fraction of each weight's norm set by lr (x eta): AdamW's LR is
# not theirs. power (your own fit, of runs with the optimizer you train with) suits all.
# lr_scaling: sqrt is Adam's rule (Malladi et al. 2022) and LAMB's (You et al. 2020), linear
# is SGD's (Goyal et al. 2017), which LARS follows; AdamW and Muon keep both.
OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adamw", build_adamw, _adam_state, (1e-5, 3e-2), elementwise=True,
                  mup=True),
    OptimizerSpec("lamb", build_lamb, _adam_state, (1e-4, 1e-1),
                  lr_rules=frozenset({"fixed", "power"}), lr_scalings=frozenset({"none", "sqrt"}),
                  why="LAMB's step is lr x each tensor's norm: deepseek's AdamW LR law does not "
                      "apply, and its batch scaling is sqrt (You et al. 2020)"),
    OptimizerSpec("lars", build_lars, _momentum_state, (1e-1, 50.0),
                  lr_rules=frozenset({"fixed", "power"}),
                  lr_scalings=frozenset({"none", "linear"}),
                  why="LARS's step is lr x eta x each tensor's norm: deepseek's AdamW LR law "
                      "does not apply, and its batch scaling is linear, SGD's (You et al. 2017)"),
    OptimizerSpec("muon", build_muon, _muon_state, (1e-5, 5e-2), mup=True,
                  orthogonalises=True),
    OptimizerSpec("adafactor", _adafactor, _factored_state, (1e-4, 1.0),
                  lr_rules=frozenset({"fixed", "power"}), lr_scalings=frozenset({"none", "sqrt"}),
                  why="Adafactor's step is lr x each tensor's RMS (a relative step): deepseek's "
                      "AdamW LR law does not apply, and its batch scaling is Adam's sqrt",
                  # torch 2.13's Adafactor on a DTensor: "aten.pow_.Scalar: in-place
                  # operations that require placement changes are not supported"
                  on_dtensor=False),
)}


def name_problems(name: str) -> list[str]:
    """``optim.name`` against the registry: the schema takes any string, this is its closed
    set (decision/checks.py reports it before anything is built)."""
    if name in OPTIMIZERS:
        return []
    return [f"optim.name={name} is no optimizer here: use optim={'|'.join(OPTIMIZERS)} "
            "(src/pretrain/optim/specs.py OPTIMIZERS)"]


def spec(name: str) -> OptimizerSpec:
    """``optim.name``'s spec; a name with none is a ValueError naming the key and the
    choices."""
    if problem := name_problems(name):
        raise ValueError(problem[0])
    return OPTIMIZERS[name]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float,
                    device: torch.device,
                    also_embeddings: Iterable[torch.nn.Parameter] = ()) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer (its spec's ``build``). Weight decay on matrices (ndim >= 2)
    but not on embeddings, norms or biases. ``also_embeddings``: parameters to treat as
    embeddings though no nn.Embedding holds them here (an output head tied to an embedding
    that a pipeline put on another stage). Under model.parametrization=mup|completep only an
    optimizer with a muP rule builds (its groups are muP's)."""
    s, opt = model_scales(model), spec(cfg.name)
    if s.active and not opt.mup:
        raise ValueError(f"model.parametrization={s.kind} has no rule for optim={cfg.name}: "
                         f"use optim={' or optim='.join(mup_optimizers())}")
    return opt.build(model, cfg, lr, device, list(also_embeddings))


def mup_optimizers() -> list[str]:
    return [n for n, s in OPTIMIZERS.items() if s.mup]


def mup_problems(parametrization: str, name: str) -> list[str]:
    """model.parametrization=mup|completep with an optimizer that has no muP rule."""
    if parametrization == "sp" or spec(name).mup:
        return []
    return [f"model.parametrization={parametrization} with optim={name}: no muP rule for "
            f"optim={name} is implemented (a trust ratio's step is set relative to each "
            f"tensor's norm already); use optim={' or optim='.join(mup_optimizers())}, or "
            "model.parametrization=sp"]


# Beyond this factor outside an optimizer's lr_range an LR is refused
# (optim.allow_lr_out_of_range=true runs it anyway): above, the run diverges; below, it does
# not train.
LR_REFUSE_FACTOR = 100.0


def usual_lr(name: str) -> float:
    """The middle (geometric) of ``optim=name``'s usual range: about its preset's LR
    (AdamW 5.5e-4, Muon 7.1e-4, LAMB 3.2e-3, LARS 2.2)."""
    lo, hi = spec(name).lr_range
    return math.sqrt(lo * hi)


def lr_range_warning(name: str, lr: float) -> str | None:
    """What the plan says when ``lr`` is outside ``optim=name``'s usual range, else None."""
    lo, hi = spec(name).lr_range
    if lo <= lr <= hi:
        return None
    side = "below" if lr < lo else "above"
    fate = ("the run will likely diverge (non-finite losses, skipped steps, then a stop)"
            if lr > hi else "the run will barely train")
    return (f"lr {lr:.3g} is far {side} optim={name}'s usual range {lo:g} to {hi:g} "
            f"(src/pretrain/optim/specs.py lr_range): {fate}. An LR meant for another "
            f"optimizer? Set optim.lr within the range (e.g. optim.lr={usual_lr(name):.2g})")


def lr_out_of_range_problem(cfg: OptimConfig) -> str | None:
    """A refusal when ``optim.lr`` is more than LR_REFUSE_FACTOR outside the usual range
    (unless ``optim.allow_lr_out_of_range``), else None."""
    if str(cfg.name) not in OPTIMIZERS:
        return None  # name_problems says so
    lo, hi = spec(cfg.name).lr_range
    if cfg.allow_lr_out_of_range or not cfg.lr > 0 or \
            lo / LR_REFUSE_FACTOR <= cfg.lr <= hi * LR_REFUSE_FACTOR:
        return None
    side = "above" if cfg.lr > hi else "below"
    return (f"optim.lr={cfg.lr:g} is more than {LR_REFUSE_FACTOR:g}x {side} optim={cfg.name}'s "
            f"usual range {lo:g} to {hi:g}: set optim.lr within it (e.g. optim.lr="
            f"{usual_lr(str(cfg.name)):.2g}), or optim.allow_lr_out_of_range=true if you mean it")


def lr_rule_problems(cfg: OptimConfig) -> list[str]:
    """The LR rule or batch scaling ``cfg`` asks for, if ``optim.name`` does not take it."""
    s = spec(cfg.name)
    out = []
    if cfg.lr_rule not in s.lr_rules:
        out.append(f"optim.lr_rule={cfg.lr_rule} does not apply to optim={cfg.name} "
                   f"({s.why}): use optim.lr_rule={'|'.join(sorted(s.lr_rules))}")
    if cfg.lr_scaling not in s.lr_scalings:
        out.append(f"optim.lr_scaling={cfg.lr_scaling} does not apply to optim={cfg.name} "
                   f"({s.why}): use optim.lr_scaling={'|'.join(sorted(s.lr_scalings))}")
    return out
