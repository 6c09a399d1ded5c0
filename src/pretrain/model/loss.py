"""Next-token cross-entropy that never holds the whole fp32 logits tensor.

The logits of a 50k vocabulary in fp32 are the largest activation of a small GPT
(batch x seq x 50257 x 4 bytes: 400 MB for 8 x 256 tokens), and plain ``F.cross_entropy``
on bf16 logits keeps an fp32 copy plus fp32 log-probabilities for backward. Here the loss is
computed over chunks of tokens: forward keeps only each token's log-sum-exp, backward
rebuilds the softmax one chunk at a time and writes the gradient in the logits' own dtype.
At most one chunk of fp32 exists at a time. Under tensor parallelism (DTensor logits
sharded over the vocabulary, with ``loss_parallel``) the plain call is used.

That loop is for eager runs. A compiled run (``fused=True``, called inside a compiled graph:
parallel/apply.py) takes torch's own cross-entropy on the whole logits, which inductor fuses
(upcast, log-sum-exp, gradient) without storing any fp32 copy: the chunking's memory saving
without its Python loop and its dozens of kernel launches a micro batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

CHUNK_ELEMENTS = 2**24  # fp32 logits per chunk: 64 MB


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a ``vocab``-wide logits tensor. The planner
    (planning/activations.py) sizes the loss's memory with this same rule."""
    return max(1, CHUNK_ELEMENTS // vocab)


def is_chunked(n_tokens: int, vocab: int, vocab_sharded: bool = False) -> bool:
    """Whether ``cross_entropy`` takes the chunked path: not for vocabulary-sharded logits
    (``loss_parallel`` needs the plain call) nor for inputs that fit in one chunk."""
    return not vocab_sharded and n_tokens > chunk_rows(vocab)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for i in range(0, n, chunk):
            part = logits[i:i + chunk].float()
            lse[i:i + chunk] = torch.logsumexp(part, dim=-1)
            picked = part.gather(1, targets[i:i + chunk, None]).squeeze(1)
            total += (lse[i:i + chunk] - picked).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        n, chunk = logits.shape[0], ctx.chunk
        grad = torch.empty_like(logits)
        scale = grad_out.float() / n
        for i in range(0, n, chunk):
            p = torch.exp(logits[i:i + chunk].float() - lse[i:i + chunk, None])
            p.scatter_add_(1, targets[i:i + chunk, None],
                           torch.full_like(lse[i:i + chunk, None], -1.0))
            grad[i:i + chunk] = (p * scale).to(grad.dtype)
        return grad, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, fused: bool = False
                  ) -> torch.Tensor:
    """Mean token loss of logits (..., vocab) against targets (...), computed in fp32.
    ``fused``: the caller runs inside a compiled graph, where the whole-logits loss fuses."""
    logits, targets = logits.flatten(0, -2), targets.flatten()
    n, vocab = logits.shape
    # a DTensor is vocabulary-sharded (loss_parallel); a FakeTensor (tools/plan.py
    # --simulate) is not, and must take the path the real run takes
    if fused or not is_chunked(n, vocab, vocab_sharded=isinstance(logits, DTensor)):
        return F.cross_entropy(logits.float(), targets)
    return _ChunkedCrossEntropy.apply(logits, targets, chunk_rows(vocab))
