"""Muon for the hidden matrices, AdamW for the rest, as one optimizer.

torch 2.13 has Muon (``torch.optim.Muon``: momentum, Nesterov, a quintic Newton-Schulz
orthogonalisation in bf16, decoupled decay, and ``adjust_lr_fn="match_rms_adamw"``, the
0.2 sqrt(max(m, n)) scale of Moonlight (Liu et al. 2025) that gives its update AdamW's RMS,
so one LR and one weight decay serve both). It is used as it is for everything but one
line: where it orthogonalises.

Why a subclass. ``torch.optim.Muon`` accepts DTensor parameters without complaint, but then
runs Newton-Schulz as DTensor ops on the shards: DTensor's sharding propagation picks
collectives for each bf16 matmul of each iteration, and the result need not be the
one-process update (tests/optim_shard_worker.py, a 9 x 6 matrix over 2 ranks, lr 0.1,
3 steps: 2.5e-3 off when sharded on dim 0, equal when sharded on dim 1). Orthogonalisation is a
function of the WHOLE matrix, so ``ShardedMuon``
gathers the momentum-corrected update (``full_tensor()``: one all-gather over every mesh
dimension the matrix is sharded on, FSDP's and TP's), runs torch's own
``_zeropower_via_newtonschulz`` on it (bf16; ``optim.muon_ns_dtype=float32`` runs the
same iteration in fp32), and keeps this rank's shard of the result
(``redistribute`` from Replicate to the parameter's placements: a local slice, no
communication). Momentum stays sharded like the parameter (torch makes it ``zeros_like``
the gradient), so DCP saves and reshards it. On one process nothing is gathered. A step
with lr 0 (how DCP and ``tools/plan.py --simulate`` create the state) only makes the state:
it would change no weight, and skips an orthogonalisation per matrix.

Which parameters: ``muon_matrix`` (2-D tensors inside transformer blocks: attention and MLP
projections, an MoE router). Embeddings, the output head, norms, biases and the 3-D
tensors of routed experts go to AdamW (``torch.optim.Muon`` refuses anything but 2-D, and
gathering whole expert stacks would undo expert parallelism's split). ``MuonWithAdamW``
puts both behind one ``torch.optim.Optimizer``: one ``param_groups`` list (the LR schedule,
grad clipping and fp16's GradScaler walk it), one ``state`` view, and a state dict whose
groups are Muon's then AdamW's, so torch.distributed.checkpoint's
``get/set_optimizer_state_dict`` save and load it like any single optimizer.
"""

from __future__ import annotations

import re
from collections import ChainMap

import torch
from torch.distributed.tensor import DTensor, Replicate

from pretrain import torch_compat

_IN_BLOCK = re.compile(r"(^|\.)layers\.\d+\.")


def muon_matrix(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether Muon (not AdamW) updates the parameter ``name`` of this ``shape``: a 2-D
    tensor inside a transformer block (the real optimizer's and the planner's one rule)."""
    return len(shape) == 2 and bool(_IN_BLOCK.search(name))


NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz(m: torch.Tensor, group: dict, dtype: torch.dtype = torch.bfloat16
                  ) -> torch.Tensor:
    """Orthogonalise the whole matrix ``m``: torch's ``_zeropower_via_newtonschulz`` (bf16,
    as Keller Jordan's and Moonlight's Muon run it), or for another ``dtype`` the same
    quintic iteration, line for line but the cast, in that dtype (torch's casts to bf16
    whatever it is given; tests/test_optimizers.py checks the two agree in bf16)."""
    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    if dtype == torch.bfloat16:
        return torch_compat.private("muon_newton_schulz")(m, coefficients, steps, eps)
    a, b, c = coefficients
    x = m.to(dtype, copy=True)  # a copy: divided in place below, as torch's bf16 one is
    if m.size(0) > m.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if m.size(0) > m.size(1) else x


def orthogonalise(update: torch.Tensor, group: dict, dtype: torch.dtype = torch.bfloat16
                  ) -> torch.Tensor:
    """Newton-Schulz (in ``dtype``) on the whole matrix; this rank's shard of the result."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, group, dtype)
    mesh = update.device_mesh
    whole = DTensor.from_local(newton_schulz(update.full_tensor(), group, dtype), mesh,
                               [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, update.placements)


def orthogonalisation_bytes(shape: tuple[int, int], gathered_bytes: int, ns_bytes: int = 2
                            ) -> int:
    """Transient bytes of one matrix's orthogonalisation: the gathered update
    (``gathered_bytes`` per element; 0 when not sharded), and Newton-Schulz's working set
    in its dtype (``ns_bytes`` per element: the matrix, its next iterate, and two k x k Gram
    terms, k = min(m, n))."""
    m, n = shape
    k = min(m, n)
    return gathered_bytes * m * n + ns_bytes * (2 * m * n + 2 * k * k)


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose orthogonalisation sees whole matrices under FSDP2 and
    tensor parallelism (see the module docstring). The step is torch's
    ``_single_tensor_muon`` line for line but for ``orthogonalise``. ``ns_dtype`` (the
    config's ``optim.muon_ns_dtype``, not saved with the state: the run's config decides):
    the dtype Newton-Schulz runs in."""

    def __init__(self, params, *args, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            if group["lr"] == 0:  # only the state: no weight would change
                continue
            for p, g, buf in zip(params, grads, bufs, strict=True):
                self._update(p, g, buf, group)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, group: dict
                ) -> None:
        momentum, lr = group["momentum"], group["lr"]
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if group["nesterov"] else buf
        update = orthogonalise(update, group, self.ns_dtype)
        p.mul_(1 - lr * group["weight_decay"])
        adjust_lr = torch_compat.private("muon_adjust_lr")
        p.add_(update, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class _EitherState(ChainMap):
    """Both optimizers' states as one mapping. A plain ChainMap would look a key up in the
    first map, a defaultdict, and so make (and return) an empty state for every AdamW
    parameter there: the AdamW state would vanish from state_dict and checkpoints."""

    def __getitem__(self, key):
        for states in self.maps:
            if key in states:
                return states[key]
        raise KeyError(key)


class MuonWithAdamW(torch.optim.Optimizer):
    """Two torch optimizers as one: ``param_groups`` are Muon's groups then AdamW's (the
    same dicts: a scheduler's LR reaches them), ``state`` a live view of both states, and
    ``load_state_dict`` hands each optimizer its own groups and state back."""

    def __init__(self, muon: ShardedMuon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, {})
        self._link()

    def _link(self) -> None:
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self.state = _EitherState(self.muon.state, self.adamw.state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        groups, k = state_dict["param_groups"], len(self.muon.param_groups)
        for opt, saved in ((self.muon, groups[:k]), (self.adamw, groups[k:])):
            mine = {i for g in saved for i in g["params"]}
            opt.load_state_dict({"state": {i: s for i, s in state_dict["state"].items()
                                           if i in mine},
                                 "param_groups": saved})
        self._link()
