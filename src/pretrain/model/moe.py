"""Mixture of experts: a dropless, token-choice MoE feed-forward (Mixtral, OLMoE, DeepSeek-V3's
routing options), a plain module like the rest of the model.

Each token's router logits (an fp32 matmul) go through a softmax over all experts; the token
goes to its ``top_k`` experts (chosen on the scores plus a per-expert bias under
``aux_free`` balancing), weighted by their scores (renormalised to sum to one when
``norm_topk``). No token is dropped: tokens are sorted by expert and each expert's SwiGLU
(or GELU) runs over its group with grouped GEMMs (``torch._grouped_mm`` where it runs; a loop
over the experts elsewhere, the same numbers). Always-on shared experts (DeepSeek) add a
dense MLP.

Load balancing, as ``model.moe_balance`` says:

- ``aux_loss``: the Switch/GShard loss ``alpha E sum_i f_i P_i`` per layer (f_i the fraction
  of token slots routed to expert i, P_i its mean router probability). It reaches the
  router's gradient through ``AuxLoss`` (Megatron-LM's ``MoEAuxLossAutoScaler``): the layer's
  output carries it into backward, so the training loop and the pipeline schedule see only
  the language-model loss. ``aux_loss_scale`` sets what one unit of loss is in backward
  (the micro batch weight times the fp16 loss scale), set by the step strategies.
- ``aux_free``: DeepSeek-V3's bias update, ``b_i += gamma sign(mean load - load_i)`` after
  each optimizer step on the step's token counts summed over the data-parallel ranks
  (``update_biases``, installed by the train module as an optimizer hook).
- ``none``.

A router z-loss (ST-MoE, ``moe_z_coeff``) is added through ``AuxLoss`` too. Each layer counts
its tokens per expert on the device (``tokens_per_expert``, summed until read): the load
imbalance the log reports (``routing_stats``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from pretrain import torch_compat
from pretrain.config.schema import ModelConfig

_AUX_SCALE = [1.0]


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block ``layer`` has a mixture of experts (the one rule: model, planner, HF
    export)."""
    return cfg.moe_experts > 0 and layer >= cfg.moe_first_dense


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """What one unit of loss is worth in the backward run inside this block (a micro
    batch's weight in the mean over micro batches, times the fp16 loss scale)."""
    _AUX_SCALE[0], old = scale, _AUX_SCALE[0]
    try:
        yield
    finally:
        _AUX_SCALE[0] = old


class AuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` gets gradient ``_AUX_SCALE`` as if it had
    been added to the loss (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, _AUX_SCALE[0])


def grouped_mm_kernel():
    """torch's grouped GEMM (a private name: torch_compat), or None on a torch without it.
    Looked up when a module is built, not in its forward: the look-up imports, which
    torch.compile does not trace (a graph break in a whole-model graph)."""
    return torch_compat.private("grouped_mm") if torch_compat.has("grouped_mm") else None


def _grouped_mm_runs(mm, x: torch.Tensor, *dims: int) -> bool:
    """Whether torch._grouped_mm (``mm``; None: this torch has none) takes these operands:
    rows 16-byte aligned, and bf16 where it is traced (its meta kernel, which torch.compile
    runs, accepts bf16 only; eager CPU takes fp32 too). On GPUs PyTorch runs it on every
    architecture from sm80, with dedicated kernels on sm90+ (torchtitan's choice there)."""
    if mm is None or x.device.type not in ("cpu", "cuda"):
        return False
    if not all(d * x.element_size() % 16 == 0 for d in dims):
        return False
    if x.dtype == torch.bfloat16:
        return True
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                   mm=None) -> torch.Tensor:
    """Rows of ``x`` sorted by group (``counts`` rows each) times each group's ``w[g]^T``
    (w: groups x out x in, nn.Linear's orientation); ``mm``: ``grouped_mm_kernel()``, else
    looked up here (eager callers only)."""
    w = w.to(x.dtype)
    mm = mm if mm is not None else grouped_mm_kernel()
    if _grouped_mm_runs(mm, x, w.shape[1], w.shape[2]):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return mm(x, w.transpose(-2, -1), offs=offsets)
    outs = [rows @ w[g].t() for g, rows in enumerate(x.split(counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


class GroupedExperts(nn.Module):
    """``n`` experts' weights as 3-D tensors (experts x out x in), so grouped GEMMs run them
    together and FSDP / expert parallelism shard them along the experts."""

    def __init__(self, n: int, d_model: int, hidden: int, swiglu: bool):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, d_model))  # up (and SiLU input)
        self.w2 = nn.Parameter(torch.empty(n, d_model, hidden))  # down
        self.w3 = nn.Parameter(torch.empty(n, hidden, d_model)) if swiglu else None  # gate
        self.mm = grouped_mm_kernel()

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, ``counts`` rows for each expert this module holds (all of
        them, or with expert parallelism this rank's: then the weights are DTensors split
        along the experts, and each rank runs its own slice). Under autocast (one process)
        the rows are cast to its dtype first: torch's grouped GEMM is not on autocast's
        lists, and fp32 rows would take the per-expert loop, whose data-dependent splits
        inductor fails to compile."""
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        h = grouped_linear(x, _local(self.w1), counts, self.mm)
        if self.w3 is not None:
            h = F.silu(h) * grouped_linear(x, _local(self.w3), counts, self.mm)
        else:
            h = F.gelu(h, approximate="tanh")
        return grouped_linear(h, _local(self.w2), counts, self.mm)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class MoE(nn.Module):
    """The feed-forward of an MoE block: router, routed experts, optional shared experts."""

    def __init__(self, cfg: ModelConfig, hidden: int, shared: nn.Module | None):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.norm_topk, self.balance = cfg.moe_norm_topk, str(cfg.moe_balance)
        self.aux_coeff, self.z_coeff = cfg.moe_aux_coeff, cfg.moe_z_coeff
        self.bias_rate = cfg.moe_bias_rate
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.d_model, hidden,
                                      swiglu=cfg.mlp == "swiglu")
        self.shared = shared
        # aux_free's selection bias: state (saved with the model), not a parameter.
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts), persistent=True)
        # Tokens routed to each expert: since the last log (routing_stats) and in this
        # step (update_biases).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.moe_experts),
                             persistent=False)
        self.register_buffer("step_tokens", torch.zeros(cfg.moe_experts), persistent=False)
        self.last_aux: torch.Tensor | None = None
        self.counting = True  # off for forwards that are not training steps (uncounted)

    @torch.no_grad()
    def reset_state(self) -> None:
        """Zero bias and counts (after a meta-device construction)."""
        for buffer in (self.expert_bias, self.tokens_per_expert, self.step_tokens):
            buffer.zero_()
        self.last_aux = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits (fp32), the top-k experts of each token and their weights."""
        logits = F.linear(x.float(), self.router.weight.float())
        scores = logits.softmax(dim=-1)
        choose = scores + self.expert_bias if self.balance == "aux_free" else scores
        experts = choose.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, experts, weights

    def _aux(self, logits: torch.Tensor, experts: torch.Tensor,
             counts: torch.Tensor) -> torch.Tensor | None:
        """The balancing and z losses of this micro batch, or None when both are off."""
        terms = []
        if self.balance == "aux_loss" and self.aux_coeff > 0:
            f = counts.float() / experts.numel()  # fraction of token slots per expert
            p = logits.softmax(dim=-1).mean(dim=0)
            terms.append(self.aux_coeff * self.n_experts * (f * p).sum())
        if self.z_coeff > 0:
            terms.append(self.z_coeff * torch.logsumexp(logits, dim=-1).square().mean())
        return sum(terms) if terms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, experts, weights = self.route(x)
        flat = experts.reshape(-1)
        # bincount's output shape depends on the values; this one's does not (fake tensors
        # of --simulate, compile), and integer sums are exact in any order
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat.device)
        counts = counts.scatter_add_(0, flat, torch.ones_like(flat))
        # Training forwards only (not evaluation or sampling). An activation-checkpoint
        # recompute counts a layer's tokens twice: harmless, as both readers use ratios
        # within a layer (max over mean; sign of mean - load).
        if self.training and self.counting:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
                self.step_tokens += counts.to(self.step_tokens.dtype)
        order = flat.argsort(stable=True)
        token = order // self.top_k  # the token each sorted slot came from
        out = self.experts(x[token], counts)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)
        aux = self._aux(logits, experts, counts) if self.training else None
        if aux is not None and torch.is_grad_enabled():
            if self.counting:
                self.last_aux = aux.detach()
            y = AuxLoss.apply(y, aux)
        return y.reshape(shape)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def uncounted(model: nn.Module) -> Iterator[None]:
    """Forwards in train mode that are not training steps: torch's pipeline stage runs one
    on its first step, on stand-in inputs, to learn its output shapes. Their tokens must
    not reach the load the log shows or aux_free's bias follows."""
    layers = [m for _, m in moe_layers(model)]
    for m in layers:
        m.counting = False
    try:
        yield
    finally:
        for m in layers:
            m.counting = True


@torch.no_grad()
def update_biases(model: nn.Module, sum_over_replicas) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each
    ``aux_free`` layer's bias moves by ``gamma`` against its expert's load on this step
    (token counts summed over the data-parallel ranks by ``sum_over_replicas``)."""
    layers = [m for _, m in moe_layers(model) if m.balance == "aux_free"]
    if not layers:
        return
    counts = sum_over_replicas(torch.stack([m.step_tokens for m in layers]))
    for m, load in zip(layers, counts, strict=True):
        m.expert_bias += m.bias_rate * torch.sign(load.mean() - load)
        m.step_tokens.zero_()


def routing_stats(model: nn.Module, sum_over_replicas) -> dict[str, float]:
    """Per MoE layer, the busiest expert's tokens over the mean (1 = balanced) since the
    last read, and the last micro batch's auxiliary loss; then the counts start again."""
    out: dict[str, float] = {}
    layers = moe_layers(model)
    if not layers:
        return out
    counts = sum_over_replicas(torch.stack([m.tokens_per_expert for _, m in layers]))
    for (name, m), load in zip(layers, counts.tolist(), strict=True):
        layer = name.split(".")[-2] if name.endswith(".moe") else name
        mean = sum(load) / len(load)
        out[f"moe/max_load_{layer}"] = max(load) / mean if mean else 0.0
        if m.last_aux is not None:
            out[f"moe/aux_loss_{layer}"] = float(m.last_aux)
        m.tokens_per_expert.zero_()
    return out
