"""Take from torch every private name pretrain.torch_compat lists, then import every module
of the package and run train.py with the arguments given: a torch that has none of them, as
far as the package can see (tests/test_torch_compat.py runs this in its own process).

A method (a PipelineStage hook) is deleted from the torch class that defines it, a name of
the ``torch`` package itself or a setting of a config module (inductor's) deleted from it. A
module's name cannot simply be deleted: torch
reads many of them itself (FakeTensor, is_traceable_wrapper_subclass), from its own module's
globals or by a lazy import. So the module is replaced, in ``sys.modules`` and on its parent
package, by a copy without the name, whose ``__getattr__`` still hands it to torch's code and
refuses it to ``pretrain``'s (by the asking frame's module): every way the package could
reach it (an import statement at any depth, ``getattr``, torch_compat's look-up) fails.

Prints one JSON line first: what was taken, which names the package still finds, which
modules it imported."""

from __future__ import annotations

import importlib
import json
import pkgutil
import runpy
import sys
import types

import torch

import pretrain
from pretrain import torch_compat


def _asked_by_pretrain() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == "pretrain" or caller.startswith("pretrain.")


def _hide(module: types.ModuleType, names: set[str]) -> None:
    """``module`` without ``names`` for the package, unchanged for torch."""
    copy = types.ModuleType(module.__name__, module.__doc__)
    copy.__dict__.update({k: v for k, v in vars(module).items() if k not in names})

    def __getattr__(name: str):  # only names missing from the copy get here
        if name in names and not _asked_by_pretrain():
            return getattr(module, name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r} "
                             "(taken away by tests/no_private_torch.py)")

    copy.__getattr__ = __getattr__
    sys.modules[module.__name__] = copy
    parent, _, leaf = module.__name__.rpartition(".")
    if parent and getattr(sys.modules.get(parent), leaf, None) is module:
        setattr(sys.modules[parent], leaf, copy)


def take_private_names() -> list[str]:
    taken, per_module = [], {}
    for entry in torch_compat.PRIVATE.values():
        for where in entry.where:
            module, _, attrs = where.partition(":")
            *path, leaf = attrs.split(".")
            try:
                owner = importlib.import_module(module)
                for attr in path:
                    owner = getattr(owner, attr)
            except (ImportError, AttributeError):
                continue
            if isinstance(owner, type):  # from the class of torch's that defines it
                holder = next((c for c in owner.__mro__ if leaf in vars(c)), None)
                if holder is not None:
                    delattr(holder, leaf)
                    taken.append(where)
            elif owner is torch and hasattr(torch, leaf):
                delattr(torch, leaf)
                taken.append(where)
            elif leaf in vars(owner):
                per_module.setdefault(owner, set()).add(leaf)
                taken.append(where)
            elif hasattr(owner, leaf):  # a config module's setting: its own delete hides it
                delattr(owner, leaf)
                taken.append(where)
    for module, names in per_module.items():
        _hide(module, names)
    return taken


if __name__ == "__main__":
    taken = take_private_names()
    modules = [m.name for m in pkgutil.walk_packages(pretrain.__path__, "pretrain.")]
    for name in modules:
        importlib.import_module(name)
    print(json.dumps({"torch": torch.__version__, "taken": taken,
                      "found": [k for k in torch_compat.PRIVATE if torch_compat.has(k)],
                      "imported": modules}), flush=True)
    train = sys.argv[1]
    sys.argv = [train, *sys.argv[2:]]
    runpy.run_path(train, run_name="__main__")
