"""How many aten ops one training step dispatches: the host's share of a step.

A GPU runs a step's kernels only as fast as the host launches them: each aten op the eager
step dispatches costs the host a few microseconds (Python, the dispatcher, autograd, the
launch), whatever the batch size. When that adds up to more than the kernels' own time the
step is host-bound (the GPT-2 124M eager trainer step on an H100: 1.00 s of CPU against
0.49 s of GPU work in two steps), and no FLOP count sees it.

The count is taken here, on the CPU, by the dispatcher (a ``TorchDispatchMode`` counting
every aten op) while the project's own model and loss run one forward and backward at a
tiny width and sequence (the count does not depend on them): with one block and with two,
so a block's ops and the rest's are known apart; the chunked loss's ops with two chunks and
with three, so the real shape's chunk count (``loss.chunk_rows``) gives its ops; and the
optimizer step (fused AdamW, as on a GPU) and gradient clipping. Counts are cached per
model structure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pretrain.config.schema import ModelConfig

# Ops that launch one kernel each and that inductor does not fuse into a neighbour: a
# compiled block launches these and about one fused kernel between two of them.
HEAVY = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "attention", "embedding_dense")


def _Count():  # noqa: N802 (a mode class, made when first needed)
    """A dispatch mode counting the aten ops (and the heavy ones) run under it. Its base
    class lives in a private torch module: imported here, not when the planner loads."""
    from pretrain.torch_compat import private

    TorchDispatchMode = private("TorchDispatchMode")  # noqa: N806 (a class)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.heavy = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten":
                self.ops += 1
                self.heavy += any(h in func.overloadpacket.__name__ for h in HEAVY)
            return func(*args, **(kwargs or {}))

    return Count()


@dataclass(frozen=True)
class OpCount:
    """aten ops of one forward + backward of one micro batch, by where they run."""

    outside: int  # embeddings, final norm, head (not the loss)
    per_block: int
    heavy_per_block: int  # matmuls and attention of one block (forward + backward)
    loss_base: int  # the loss's ops, less those per chunk
    loss_per_chunk: int
    step: int  # gradient clipping and the optimizer step, once per step


def _tiny(m: ModelConfig, layers: int) -> ModelConfig:
    """``m`` at a width and sequence that cost nothing, its structure kept."""
    head_dim = 8
    kv = m.n_kv_head if getattr(m, "n_kv_head", None) else None
    out = replace(m, n_layer=layers, d_model=head_dim * m.n_head, seq_len=8, vocab_size=64,
                  pad_vocab_to=1, d_ff=None, moe_d_ff=None, dropout=0.0)
    return replace(out, n_kv_head=kv) if kv else out


def _fwd_bwd(m: ModelConfig) -> tuple[int, int, torch.nn.Module]:
    from pretrain.model.gpt import GPT

    with torch.device("cpu"):
        model = GPT(m)
    model.tie_weights()
    x = torch.randint(0, m.vocab_size, (1, m.seq_len))
    with _Count() as c:
        model(x).float().sum().backward()
    return c.ops, c.heavy, model


def _loss_ops(chunks: int) -> int:
    from pretrain.model.loss import _ChunkedCrossEntropy

    logits = torch.randn(4 * chunks, 16, requires_grad=True)
    targets = torch.randint(0, 16, (4 * chunks,))
    with _Count() as c:
        _ChunkedCrossEntropy.apply(logits, targets, 4, 0.0)[0].backward()
    return c.ops


def _step_ops(model: torch.nn.Module) -> int:
    params = [p for p in model.parameters() if p.grad is not None]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()  # state exists, as on every step after the first
    with _Count() as c:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return c.ops


def count_ops(m: ModelConfig) -> OpCount:
    """The counts for ``m``'s structure (widths, sequence and depth do not change them)."""
    key = repr(_tiny(m, 1))
    if key not in _COUNTS:
        _COUNTS[key] = _count(m)
    return _COUNTS[key]


_COUNTS: dict[str, OpCount] = {}


def _count(m: ModelConfig) -> OpCount:
    one, heavy1, _ = _fwd_bwd(_tiny(m, 1))
    two, heavy2, model = _fwd_bwd(_tiny(m, 2))
    block = two - one
    loss2, loss3 = _loss_ops(2), _loss_ops(3)  # (one chunk takes no loop's second turn)
    return OpCount(outside=one - block, per_block=block, heavy_per_block=heavy2 - heavy1,
                   loss_base=max(0, 3 * loss2 - 2 * loss3), loss_per_chunk=loss3 - loss2,
                   step=_step_ops(model))


def loss_chunks(m: ModelConfig, micro_batch: int, vocab_sharded: bool = False) -> int:
    """Chunks of the loss for one micro batch (0: the plain F.cross_entropy path)."""
    from pretrain.model.gpt import padded_vocab_size
    from pretrain.model.loss import chunk_rows, is_chunked

    n, vocab = micro_batch * m.seq_len, padded_vocab_size(m)
    return math.ceil(n / chunk_rows(vocab)) if is_chunked(n, vocab, vocab_sharded) else 0
