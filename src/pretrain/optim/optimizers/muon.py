"""optim=muon: Muon (torch's, orthogonalising whole matrices: optim/muon.py's ``ShardedMuon``)
on the hidden matrices, AdamW as optim=adamw builds it on the rest, as one optimizer
(``MuonWithAdamW``)."""

from __future__ import annotations

import math

import torch

from pretrain.config.schema import OptimConfig
from pretrain.optim.factory import decay_groups, model_scales
from pretrain.optim.muon import NS_DTYPES, MuonWithAdamW, ShardedMuon, muon_matrix
from pretrain.optim.optimizers.adamw import adam_state, adamw_groups, decayed_adamw, mup_groups
from pretrain.optim.registry import OptimizerSpec, register


def muon_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """Muon's momentum on its matrices (``muon.muon_matrix``), AdamW's state on the rest."""
    if muon_matrix(name, shape):
        return pb * math.prod(local)
    return adam_state(name, shape, local, pb)


def build_muon(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
               also_embeddings: list[torch.nn.Parameter]) -> MuonWithAdamW:
    """Muon (torch's, orthogonalising whole matrices) on the hidden matrices with AdamW's
    LR and decay (``match_rms_adamw``); AdamW, as ``optim=adamw`` builds it, on the rest.
    Under mup/completep Muon's LR (AdamW's RMS, so AdamW's rule) is divided by the width
    ratio and its AdamW part takes muP's groups."""
    matrices = [p for n, p in model.named_parameters()
                if p.requires_grad and muon_matrix(n, p.shape)]
    s = model_scales(model)
    muon = ShardedMuon(matrices, lr=lr * s.hidden_lr if s.active else lr,
                       weight_decay=cfg.weight_decay * s.hidden_decay,
                       momentum=0.95 if cfg.momentum is None else cfg.momentum,
                       ns_steps=cfg.ns_steps, adjust_lr_fn="match_rms_adamw",
                       ns_dtype=NS_DTYPES[cfg.muon_ns_dtype])
    skip = {id(p) for p in matrices}
    if s.active:
        groups = [g for g in mup_groups(model, cfg, lr, s, skip) if g["params"]]
        return MuonWithAdamW(muon, adamw_groups(groups, cfg, lr, device))
    decay, no_decay = decay_groups(model, also_embeddings, skip=skip)
    return MuonWithAdamW(muon, decayed_adamw(decay, no_decay, cfg, lr, device,
                                             drop_empty=True))


# AdamW's LRs (match_rms_adamw); llama-tiny's best was 8e-3 (README). Muon with
# match_rms_adamw gives its updates AdamW's RMS (Moonlight reuses AdamW's LR and decay
# unchanged), so deepseek's AdamW law and every batch scaling carry over.
register(OptimizerSpec(
    "muon", build_muon, muon_state, (1e-5, 5e-2),
    reads=frozenset({"momentum", "ns_steps", "muon_ns_dtype", "betas", "eps", "fused",
                     "weight_decay"}),
    mup=True, orthogonalises=True))
