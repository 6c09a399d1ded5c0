"""The services on the loop's seam (``hooks.Hook``): every module of this package, each one
service that registers itself where it is defined (``@hooks.register(order)``).
``build_hooks`` imports the package's modules (``pkgutil``: a new module is found as it is,
with no line here) and builds what they registered, in their order. pyproject.toml's
training-wing contract covers the package as one layer, above the loop's helpers
(evaluation, metrics, ...) and below the loop."""

from __future__ import annotations

import importlib
import pkgutil

from pretrain.checkpoint.folder import META_KEYS
from pretrain.train.hooks import Hook, LoopContext, registered

# meta.json's own keys (checkpoint/folder.py META_KEYS): a hook's state may not take one
RESERVED = META_KEYS


def discover() -> None:
    """Import every module of this package: each registers its hooks as it is imported."""
    for info in pkgutil.iter_modules(__path__, prefix=f"{__name__}."):
        importlib.import_module(info.name)


def build_hooks(ctx: LoopContext) -> list[Hook]:
    """The run's services, built after the train module and before resume (a factory
    returns None for a service the run does not use)."""
    discover()
    hooks = [factory(ctx) for factory in registered()]
    return check_names([h for h in hooks if h is not None])


def check_names(hooks: list[Hook]) -> list[Hook]:
    """Each hook's state has a key of its own in meta.json."""
    names = [h.name for h in hooks]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & RESERVED))
    if clash:
        raise ValueError(f"hook names {clash} are taken (by another hook or by meta.json's "
                         f"own keys {sorted(RESERVED)}): give each Hook a name of its own")
    return hooks
