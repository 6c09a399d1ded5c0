"""Model and optimizer state as DCP saves and loads it, whatever the layout
(``ModelOptimizer``, a DCP ``Stateful``)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

_PART_PREFIX = re.compile(r"^\d+\.")


class ModelOptimizer(Stateful):
    """Model and optimizer state as DCP wants it: the plain model's parameter names, DTensors
    for shards, whatever the layout.

    ``get_state_dict`` / ``set_state_dict`` hide the wrappers (FSDP2, compile, activation
    checkpointing). A rank may hold several pipeline stages (``parts``): their names are the
    whole model's already (layers keep their global index), so their states are merged. A
    tied output head is stored once, as ``tok_emb.weight``: a pipeline's last stage holds its
    own copy of it (kept equal to the embedding), which saves and loads under that name.
    """

    def __init__(self, parts: torch.nn.Module | list[torch.nn.Module],
                 optimizer: torch.optim.Optimizer | None):
        self.parts = list(parts) if isinstance(parts, (list, tuple)) else [parts]
        self.optimizer = optimizer
        self.container = (self.parts[0] if len(self.parts) == 1
                          else torch.nn.ModuleList(self.parts))
        self.tied = bool(getattr(getattr(self.parts[0], "cfg", None), "tie_embeddings", False))

    def _canonical(self, name: str) -> str:
        name = _PART_PREFIX.sub("", name) if len(self.parts) > 1 else name
        return "tok_emb.weight" if self.tied and name == "lm_head.weight" else name

    def _model_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            for name, t in get_model_state_dict(part).items():
                if (
                    self.tied
                    and name == "lm_head.weight"
                    and getattr(part, "tok_emb", None) is not None
                ):
                    continue  # the same tensor as tok_emb.weight: stored once
                out[self._canonical(name)] = t
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self._model_state()}
        if self.optimizer is not None:
            osd = get_optimizer_state_dict(self.container, self.optimizer)
            state["optim"] = {
                "state": {self._canonical(k): v for k, v in osd["state"].items()},
                "param_groups": [{**g, "params": [self._canonical(p) for p in g["params"]]}
                                 for g in osd["param_groups"]],
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model_sd = state["model"]
        for part in self.parts:
            names = get_model_state_dict(part).keys()
            mine = {n: model_sd[self._canonical(n)] for n in names
                    if self._canonical(n) in model_sd}
            set_model_state_dict(part, mine, options=StateDictOptions(strict=False))
        if self.optimizer is None:
            return
        # Back from canonical names to the container's names (with the part prefix).
        template = get_optimizer_state_dict(self.container, self.optimizer)
        to_mine = {self._canonical(k): k for g in template["param_groups"] for k in g["params"]}
        osd = state["optim"]
        set_optimizer_state_dict(self.container, self.optimizer, {
            "state": {to_mine[k]: v for k, v in osd["state"].items() if k in to_mine},
            "param_groups": [{**g, "params": [to_mine[p] for p in g["params"] if p in to_mine]}
                             for g in osd["param_groups"]],
        })
