"""The chunked cross-entropy equals the plain one, in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pretrain.model.loss as loss_mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_plain(dtype, monkeypatch):
    # 3 x 40 tokens over a 50-token vocabulary, in chunks of 7 tokens (the last one partial).
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 7 * 50)
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 40, 50, generator=g)).to(dtype)
    targets = torch.randint(0, 50, (3, 40), generator=g)

    a = logits.clone().requires_grad_(True)
    got = loss_mod.cross_entropy(a, targets)
    (2.5 * got).backward()
    b = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(b.float().flatten(0, 1), targets.flatten())
    (2.5 * expected).backward()

    assert got.dtype == torch.float32
    assert got.grad_fn is not None and "Chunked" in type(got.grad_fn).__name__
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert a.grad.dtype == dtype
    # Gradients are at most 2.5 / 120 here; bf16 keeps 8 bits of mantissa.
    atol = 1e-7 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=atol, rtol=1e-2)


def test_small_inputs_use_the_plain_loss():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    got = loss_mod.cross_entropy(logits, targets)
    torch.testing.assert_close(got, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("tokens", [6, 7, 8, 40])
def test_planner_sizes_the_path_the_loss_takes(tokens, monkeypatch):
    """The planner's loss memory (planning/activations.head_and_loss) follows the path the
    loss really takes, at and around the chunk size (7 tokens of a 64-token vocabulary)."""
    from pretrain.config.schema import ModelConfig
    from pretrain.planning.activations import ActivationSetup, head_and_loss

    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 7 * 64)
    logits = torch.randn(tokens, 64, requires_grad=True)
    got = loss_mod.cross_entropy(logits, torch.randint(0, 64, (tokens,)))
    chunked = "Chunked" in type(got.grad_fn).__name__
    assert chunked == (tokens > 7) == loss_mod.is_chunked(tokens, 64)

    m = ModelConfig(n_layer=1, n_head=1, d_model=8, seq_len=tokens, vocab_size=64)
    a = ActivationSetup(micro_batch=1, compute_bytes=2, residual_bytes=2, autocast=False)
    _, transient = head_and_loss(m, a)
    # plain: fp32 log-probabilities and their gradient (8 n V); chunked: the logits'
    # gradient in the compute dtype and two fp32 chunks
    plain, chunk = 8 * tokens * 64, 2 * tokens * 64 + 8 * min(7, tokens) * 64
    assert transient == (chunk if chunked else plain)


@pytest.mark.parametrize("chunked", [True, False])
def test_z_loss_value_and_gradient_match_the_plain_formula(chunked, monkeypatch):
    """train.z_loss: cross-entropy + z x mean(logsumexp(logits)^2), value and gradient, by
    the chunked loop and by the whole-logits path, against autograd on the plain formula."""
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 7 * 50 if chunked else 10**9)
    z = 1e-2  # large enough that the term moves the gradient well above the tolerance
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(3, 40, 50, generator=g) + 2  # log-sum-exps far from 0
    targets = torch.randint(0, 50, (3, 40), generator=g)

    a = logits.clone().requires_grad_(True)
    ce, zt = loss_mod.loss_terms(a, targets, z_loss=z)
    (1.5 * (ce + zt)).backward()
    b = logits.clone().requires_grad_(True)
    flat = b.flatten(0, 1)
    ref_ce = F.cross_entropy(flat, targets.flatten())
    ref_z = z * torch.logsumexp(flat, -1).pow(2).mean()
    (1.5 * (ref_ce + ref_z)).backward()

    assert ("Chunked" in type(ce.grad_fn).__name__) == chunked
    torch.testing.assert_close(ce, ref_ce, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(zt, ref_z, atol=1e-6, rtol=1e-6)
    assert zt.item() > 1e-2  # the term is there
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)
    c = logits.clone().requires_grad_(True)  # without the term the gradient differs
    loss_mod.cross_entropy(c, targets).mul(1.5).backward()
    assert (c.grad - b.grad).abs().max() > 1e-4


def test_z_loss_zero_is_the_plain_loss_bit_for_bit(monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 7 * 50)
    logits = torch.randn(3, 40, 50, generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 50, (3, 40), generator=torch.Generator().manual_seed(3))
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ce, zt = loss_mod.loss_terms(a, targets, z_loss=0.0)
    plain = loss_mod.cross_entropy(b, targets)
    ce.backward()
    plain.backward()
    assert torch.equal(ce, plain) and zt.item() == 0.0 and torch.equal(a.grad, b.grad)
