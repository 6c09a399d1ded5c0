"""Next-token cross-entropy that never holds the whole fp32 logits tensor.

The logits of a 50k vocabulary in fp32 are the largest activation of a small GPT
(batch x seq x 50257 x 4 bytes: 400 MB for 8 x 256 tokens), and plain ``F.cross_entropy``
on bf16 logits keeps an fp32 copy plus fp32 log-probabilities for backward. Here the loss is
computed over chunks of tokens: forward keeps only each token's log-sum-exp, backward
rebuilds the softmax one chunk at a time and writes the gradient in the logits' own dtype.
At most one chunk of fp32 exists at a time. ``loss_terms`` adds the z-loss term (train.z_loss)
from the same log-sum-exps. Under tensor parallelism (DTensor logits
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
    """(mean cross-entropy, ``z`` x mean log-sum-exp squared) of a chunk-by-chunk loop. With
    ``z`` 0 the second output is a constant zero and backward is the plain loss's, op for op
    (a run without z-loss keeps its bits)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, z: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for i in range(0, n, chunk):
            part = logits[i:i + chunk].float()
            lse[i:i + chunk] = torch.logsumexp(part, dim=-1)
            picked = part.gather(1, targets[i:i + chunk, None]).squeeze(1)
            total += (lse[i:i + chunk] - picked).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk, ctx.z = chunk, z
        z_term = z * lse.square().mean() if z else torch.zeros_like(total)
        return total / n, z_term

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_z: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        n, chunk = logits.shape[0], ctx.chunk
        grad = torch.empty_like(logits)
        scale = grad_out.float() / n
        # d(z lse^2)/dlogits = 2 z lse softmax: the softmax's weight per token grows by it
        z_scale = 2 * ctx.z * grad_z.float() / n if ctx.z else None
        for i in range(0, n, chunk):
            p = torch.exp(logits[i:i + chunk].float() - lse[i:i + chunk, None])
            if z_scale is None:
                p.scatter_add_(1, targets[i:i + chunk, None],
                               torch.full_like(lse[i:i + chunk, None], -1.0))
                grad[i:i + chunk] = (p * scale).to(grad.dtype)
                continue
            weight = scale + z_scale * lse[i:i + chunk, None]
            p = p * weight
            p.scatter_add_(1, targets[i:i + chunk, None], (-scale).expand(p.shape[0], 1))
            grad[i:i + chunk] = p.to(grad.dtype)
        return grad, None, None, None


def _flat(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.flatten(0, -2), targets.flatten()


def _chunked(logits: torch.Tensor, fused: bool) -> bool:
    # a DTensor is vocabulary-sharded (loss_parallel); a FakeTensor (tools/plan.py
    # --simulate) is not, and must take the path the real run takes
    n, vocab = logits.shape
    return not fused and is_chunked(n, vocab, vocab_sharded=isinstance(logits, DTensor))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, fused: bool = False
                  ) -> torch.Tensor:
    """Mean token loss of logits (..., vocab) against targets (...), computed in fp32.
    ``fused``: the caller runs inside a compiled graph, where the whole-logits loss fuses."""
    logits, targets = _flat(logits, targets)
    if not _chunked(logits, fused):
        return F.cross_entropy(logits.float(), targets)
    return _ChunkedCrossEntropy.apply(logits, targets, chunk_rows(logits.shape[1]), 0.0)[0]


def loss_terms(logits: torch.Tensor, targets: torch.Tensor, fused: bool = False,
               z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean cross-entropy, ``z_loss`` x the mean over tokens of log-sum-exp(logits)^2):
    the training objective is their sum (PaLM's z-loss, which keeps the softmax's normaliser
    near 1 and the output layer from drifting). Both in fp32, on the path ``cross_entropy``
    takes: chunked eager, or whole logits when ``fused`` (inside a compiled graph). Not for
    vocabulary-sharded logits (decision/checks.py refuses z-loss under TP)."""
    logits, targets = _flat(logits, targets)
    if _chunked(logits, fused):
        return _ChunkedCrossEntropy.apply(logits, targets, chunk_rows(logits.shape[1]), z_loss)
    full = logits.float()
    return F.cross_entropy(full, targets), z_loss * torch.logsumexp(full, -1).square().mean()
