"""The GPT model: a plain nn.Module, read top to bottom.

Defaults reproduce GPT-2 exactly (learned positions, pre-LayerNorm, GELU, tied embeddings,
biases); options give the modern variants (RoPE, RMSNorm, SwiGLU, grouped-query attention,
untied and padded vocabulary). Nothing here knows about parallelism, precision or
compilation: those are applied from outside. Submodules are named so that tensor and
pipeline parallel plans can address them (``layers.<i>.attn.wq`` ...), and ``tok_emb``,
``pos_emb``, ``norm`` and ``lm_head`` may be set to None by a pipeline split.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.config.schema import ModelConfig
from pretrain.model.attention import (
    KERNELS,
    MASK_BUILDERS,
    document_ids,
    document_positions,
    kernel,
)
from pretrain.model.initialization import Init, init_parameters
from pretrain.model.moe import MoE, is_moe_layer, moe_layers
from pretrain.model.parametrization import attention_scale, scales
from pretrain.model.parametrization import init_std as param_init_std


def padded_vocab_size(cfg: ModelConfig) -> int:
    m = max(1, cfg.pad_vocab_to)
    return math.ceil(cfg.vocab_size / m) * m


def ffn_dim(cfg: ModelConfig) -> int:
    if cfg.d_ff is not None:
        return cfg.d_ff
    if cfg.mlp == "swiglu":  # LLaMA: 2/3 of 4d, rounded up to a multiple
        hidden = int(2 * 4 * cfg.d_model / 3)
        m = cfg.ffn_multiple_of
        return m * math.ceil(hidden / m)
    return 4 * cfg.d_model


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    """cos and sin for rotary embeddings, stacked as (2, seq, head_dim) in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by the 'rotate half' convention (as HF Llama).
    ``rope``: the tables (2, seq, head_dim), or per token (2, batch, seq, head_dim) when
    positions restart at each document (GPT.forward under document masking)."""
    t = x.shape[1]
    if rope.dim() == 4:
        cos, sin = rope[0, :, :, None, :], rope[1, :, :, None, :]
    else:
        cos, sin = rope[0, :t, None, :], rope[1, :t, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, self.n_head * self.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=cfg.bias)
        # OLMoE / OLMo 2: RMSNorm over each whole projection (all heads) before RoPE.
        self.q_norm = (
            nn.RMSNorm(self.n_head * self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        )
        self.k_norm = (
            nn.RMSNorm(self.n_kv_head * self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        )
        self.dropout = cfg.dropout
        self.scale = attention_scale(
            cfg
        )  # None: 1/sqrt(head_dim); muP: sqrt(base head_dim)/head_dim
        self.kernel = KERNELS["sdpa"]  # set by set_attention_backend

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask=None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 rather than n_head: under tensor parallelism each rank holds a slice of heads.
        q, k = self.wq(x), self.wk(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        dropout = self.dropout if self.training else 0.0
        extra = {} if mask is None else {"mask": mask}  # document masking only
        y = (
            self.kernel(q, k, v, dropout, **extra)
            if self.scale is None
            else self.kernel(q, k, v, dropout, scale=self.scale, **extra)
        )
        return self.wo(y.reshape(b, t, -1))


def expert_dim(cfg: ModelConfig) -> int:
    """One routed (or shared) expert's hidden width."""
    return cfg.moe_d_ff or ffn_dim(cfg)


def ffn_token_width(cfg: ModelConfig) -> int:
    """The feed-forward hidden units one token goes through: the MLP's, or in a mixture of
    experts top_k routed plus the shared experts' (what activations per token scale with;
    the planner assumes every layer is an MoE layer when there are experts)."""
    if not cfg.moe_experts:
        return ffn_dim(cfg)
    return (cfg.moe_top_k + cfg.moe_shared_experts) * expert_dim(cfg)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or ffn_dim(cfg)
        self.swiglu = cfg.mlp == "swiglu"
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)  # up (and SiLU input)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)  # down
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias) if self.swiglu else None  # gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    """Attention then the feed-forward: a dense MLP (``mlp``), or in an MoE layer a mixture
    of experts (``moe``, pretrain/model/moe.py). ``residual``: the multiplier of both branches
    before they join the residual stream (CompleteP's base_depth / n_layer; 1 otherwise)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        if is_moe_layer(cfg, layer):
            width = expert_dim(cfg)
            shared = (MLP(cfg, width * cfg.moe_shared_experts) if cfg.moe_shared_experts
                      else None)
            self.moe = MoE(cfg, width, shared)
        else:
            self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.residual = scales(cfg).residual

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) if hasattr(self, "moe") else self.mlp(x)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask=None) -> torch.Tensor:
        """``mask``: the document mask (a keyword, so TP's input preparation of ``attn``
        leaves it alone), None for plain causal attention."""
        extra = {} if mask is None else {"mask": mask}
        if self.residual != 1.0:
            x = x + self.residual * self.dropout(self.attn(self.attn_norm(x), rope, **extra))
            return x + self.residual * self.dropout(self.ffn(self.mlp_norm(x)))
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, **extra))
        return x + self.dropout(self.ffn(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        vocab = padded_vocab_size(cfg)
        self.tok_emb = nn.Embedding(vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos_emb == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        # A dict keyed by the global layer index keeps names stable when a pipeline stage
        # deletes the layers it does not own (the torchtitan convention).
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)
        # muP's output multiplier (base_width / d_model; 1 under sp): applied with the head,
        # so on the pipeline stage that holds it.
        self.output_scale = scales(cfg).output
        head_dim = cfg.d_model // cfg.n_head
        rope = rope_tables(head_dim, cfg.seq_len, cfg.rope_theta) if cfg.pos_emb == "rope" else None
        self.register_buffer("rope", rope, persistent=False)
        self.documents = cfg.attention_mask == "document"
        self.mask_builder = MASK_BUILDERS["sdpa"]  # set by set_attention_backend
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output matrix with the input embedding (GPT-2); call again after
        moving a meta-device model to real memory, which unties them."""
        if self.cfg.tie_embeddings and self.tok_emb is not None and self.lm_head is not None:
            self.lm_head.weight = self.tok_emb.weight

    def init_rule(self, name: str) -> Init:
        """How parameter ``name`` (the whole model's name) starts, GPT-2's way: N(0,
        init_std), residual projections (wo, w2) scaled by 1/sqrt(2 * n_layer), zero biases,
        unit norms; under mup/completep hidden matrices by 1/sqrt(width / base_width) too
        (pretrain.model.parametrization.init_std). A tied head draws the embedding's numbers, so
        a pipeline stage's copy of it starts equal."""
        module, _, kind = name.rpartition(".")
        if kind == "bias":
            return Init("zeros")
        if module.endswith("norm"):  # norm, attn_norm, mlp_norm, q_norm, k_norm
            return Init("ones")
        std = param_init_std(self.cfg, name, module)
        tied = self.cfg.tie_embeddings and name == "lm_head.weight"
        return Init("normal", std, key="tok_emb.weight" if tied else None)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter from ``seed`` (a pure function of seed, name and
        global shape: see pretrain.model.initialization), also when this module is a pipeline
        stage or holds only shards. Also rebuilds the RoPE tables, which a meta-device
        construction leaves empty."""
        init_parameters(self, seed, self.init_rule)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The buffers a meta-device construction leaves empty: the RoPE tables and each
        MoE layer's bias and token counts (a checkpoint then overwrites the bias)."""
        self.init_rope()
        for _, moe in moe_layers(self):
            moe.reset_state()

    @torch.no_grad()
    def init_rope(self) -> None:
        """Compute the RoPE tables (a buffer, not a parameter: never saved or learned)."""
        if self.rope is not None:
            head_dim = self.cfg.d_model // self.cfg.n_head
            self.rope.copy_(
                rope_tables(head_dim, self.cfg.seq_len, self.cfg.rope_theta, self.rope.device)
            )

    def forward(self, tokens: torch.Tensor, docs: torch.Tensor | None = None):
        """tokens (batch, seq) -> logits (batch, seq, padded vocab). A pipeline stage
        without the embedding receives hidden states (batch, seq, d_model) instead, and
        under document masking the document ids too, which every stage but the last
        passes on with its output: (hidden, docs)."""
        if self.documents:
            return self._document_forward(tokens, docs)
        h = tokens
        if self.tok_emb is not None:
            h = self.tok_emb(tokens)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
            h = self.drop(h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self._head(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
            if self.output_scale != 1.0:
                h = h * self.output_scale
        return h

    def _document_forward(self, tokens: torch.Tensor, docs: torch.Tensor | None):
        """model.attention_mask=document: attention block-causal within the documents of
        the window (ended by model.eod_id), positions restarting at each document. The
        first stage derives the document ids from the tokens; positions and the mask are
        rebuilt from them on every stage (cheap next to a block)."""
        h = tokens
        if self.tok_emb is not None:
            docs = document_ids(tokens, self.cfg.eod_id)
        positions = document_positions(docs)
        if self.tok_emb is not None:
            h = self.tok_emb(tokens)
            if self.pos_emb is not None:
                h = h + self.pos_emb(positions)
            h = self.drop(h)
        rope = self.rope[:, positions] if self.rope is not None else None
        mask = self.mask_builder(docs)
        for layer in self.layers.values():
            h = layer(h, rope, mask=mask)
        if self.lm_head is None:  # a pipeline stage before the last: the ids travel on
            return self._head(h), docs
        return self._head(h)

    @torch.no_grad()
    def generate(
        self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
        top_k: int | None = None, generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample continuations (no KV cache: for short samples from small models)."""
        for _ in range(max_new_tokens):
            context = tokens[:, -self.cfg.seq_len:]
            logits = self(context)[:, -1, : self.cfg.vocab_size].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens


def set_attention_backend(model: nn.Module, backend: str,
                          device: torch.device | None = None) -> None:
    """Every attention layer runs ``backend`` (on ``device``: SDPA's kernel priority)."""
    fn = kernel(backend, device)
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = fn
        if isinstance(module, GPT):
            module.mask_builder = MASK_BUILDERS.get(backend, MASK_BUILDERS["sdpa"])


def build_model(cfg, device: torch.device, attention: str, seed: int) -> GPT:
    """The whole model of ``cfg.model`` (a Config), initialised with ``seed``: constructed
    on the meta device (no memory), then materialised on ``device``. Every layout starts
    from these weights."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    set_attention_backend(model, attention, device)
    return model
