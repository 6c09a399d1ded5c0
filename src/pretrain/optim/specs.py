"""Every optimizer's spec, and what the runtime, the checks and the planner ask of them.

``OPTIMIZERS`` maps ``optim.name`` (conf/optim/<name>.yaml) to its ``OptimizerSpec``
(optim/registry.py): how it is built, which config keys it reads, which LR rules and batch
scalings it takes and its usual LR range, the bytes of state it keeps for one parameter,
whether its step is elementwise (and so may run on the host under
``parallel.offload=params``), and whether it has a muP/CompleteP rule. Each optimizer is a
module of ``optim/optimizers/`` that registers its spec where it defines it; this module
imports every one of them. The builders, the config checks, the layout rules and the memory
planner read these fields; no module outside the spec modules compares an optimizer's name.
Adding an optimizer is one module there, its YAML and its test
(docs/adding-an-optimizer.md).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Iterable
from dataclasses import fields

import torch

from pretrain.config.schema import OptimConfig
from pretrain.optim import optimizers
from pretrain.optim.factory import model_scales
from pretrain.optim.registry import SHARED_KEYS, OptimizerSpec, registered


def _load_all() -> dict[str, OptimizerSpec]:
    """Import every module of ``optim/optimizers/`` (each registers its spec), by name."""
    for module in sorted(m.name for m in pkgutil.iter_modules(optimizers.__path__)):
        importlib.import_module(f"{optimizers.__name__}.{module}")
    return registered()


OPTIMIZERS: dict[str, OptimizerSpec] = _load_all()


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
    if (
        cfg.allow_lr_out_of_range
        or not cfg.lr > 0
        or lo / LR_REFUSE_FACTOR <= cfg.lr <= hi * LR_REFUSE_FACTOR
    ):
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


def _changed(value, default) -> bool:
    if isinstance(value, list | tuple) and isinstance(default, list | tuple):
        return list(value) != list(default)
    return value != default and str(value) != str(default)


def ignored_key_warnings(cfg: OptimConfig) -> list[str]:
    """One line per optim.* key that ``cfg`` changed from OptimConfig's default and
    ``optim.name``'s builder does not read (its spec's ``reads``, beyond the keys every
    optimizer shares): Adafactor's ``optim.momentum``, say, which nothing would use."""
    s, default = spec(cfg.name), OptimConfig()
    out = []
    for f in fields(OptimConfig):
        key = f.name
        if key in SHARED_KEYS or key in s.reads:
            continue
        value = getattr(cfg, key)
        if not _changed(value, getattr(default, key)):
            continue
        readers = [n for n, o in OPTIMIZERS.items() if key in o.reads]
        reads = ", ".join(f"optim.{k}" for k in sorted(s.reads)) or "none of them"
        out.append(f"optim.{key}={value} is ignored: optim={cfg.name} does not read it "
                   f"(of the optimizer's own keys it reads {reads}); drop it, or use "
                   f"optim={'|'.join(readers)}, which read it")
    return out
