"""Attention backends: sdpa agrees with the eager reference; backend choice errors are clear."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.config.schema import ModelConfig
from pretrain.model.attention import (
    AttentionBackendError,
    eager_attention,
    resolve_backend,
    sdpa_attention,
)
from pretrain.model.gpt import (
    GPT,
    Attention,
    apply_rope,
    padded_vocab_size,
    rope_tables,
    set_attention_backend,
)
from pretrain.model.loss import cross_entropy

CPU = torch.device("cpu")


def qkv(n_head: int, n_kv_head: int, b: int = 2, t: int = 16, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, n_head, d, generator=g, requires_grad=True)
    k = torch.randn(b, t, n_kv_head, d, generator=g, requires_grad=True)
    v = torch.randn(b, t, n_kv_head, d, generator=g, requires_grad=True)
    return q, k, v


def run_kernel(kernel, q, k, v):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = kernel(q, k, v)
    # A fixed random projection of the output, so every output element gets a gradient.
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99))
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def naive_causal_attention(q, k, v):
    """Loop-by-hand reference: for each query, softmax over keys at or before it."""
    b, t, h, d = q.shape
    rep = h // k.shape[2]
    out = torch.zeros_like(q)
    for i in range(t):
        for head in range(h):
            kh = k[:, : i + 1, head // rep]
            s = (q[:, i, head, None, :] * kh).sum(-1) / math.sqrt(d)  # (b, i+1)
            out[:, i, head] = (s.softmax(-1)[..., None] * v[:, : i + 1, head // rep]).sum(1)
    return out


@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_matches_eager_outputs_and_grads(n_head, n_kv_head):
    q, k, v = qkv(n_head, n_kv_head)
    eager = run_kernel(eager_attention, q, k, v)
    sdpa = run_kernel(sdpa_attention, q, k, v)
    for a, b in zip(eager, sdpa, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        reference = naive_causal_attention(q, k, v)
    torch.testing.assert_close(eager[0], reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [eager_attention, sdpa_attention], ids=["eager", "sdpa"])
def test_attention_is_causal(kernel):
    q, k, v = qkv(4, 2)
    with torch.no_grad():
        before = kernel(q, k, v)
        k2, v2 = k.clone(), v.clone()
        k2[:, 10:] += 5.0  # change only the future of position 9
        v2[:, 10:] -= 3.0
        after = kernel(q, k2, v2)
    torch.testing.assert_close(after[:, :10], before[:, :10], atol=1e-6, rtol=0)
    assert (after[:, 10:] - before[:, 10:]).abs().max() > 0.1


def test_rope_frequencies_and_relative_positions():
    head_dim, seq = 8, 12
    rope = rope_tables(head_dim, seq, theta=10000.0)
    inv_freq = [10000.0 ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    for pos in (0, 1, 7):
        expected_cos = torch.tensor([math.cos(pos * f) for f in inv_freq * 2])
        torch.testing.assert_close(rope[0, pos], expected_cos)
    # The score between a rotated query at m and key at n depends only on m - n.
    g = torch.Generator().manual_seed(0)
    qv, kv = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    q = apply_rope(qv.expand(1, seq, 1, head_dim).contiguous(), rope)[0, :, 0]
    k = apply_rope(kv.expand(1, seq, 1, head_dim).contiguous(), rope)[0, :, 0]
    scores = q @ k.T
    torch.testing.assert_close(scores[5, 2], scores[9, 6], atol=1e-5, rtol=0)
    torch.testing.assert_close(scores[3, 3], qv @ kv, atol=1e-5, rtol=0)
    assert abs(scores[5, 2] - scores[5, 3]) > 1e-3


@pytest.mark.parametrize("n_kv_head", [None, 2], ids=["mha", "gqa"])
def test_attention_module_with_rope_sdpa_matches_eager(n_kv_head):
    cfg = ModelConfig(n_layer=1, n_head=4, n_kv_head=n_kv_head, d_model=32, seq_len=16,
                      pos_emb="rope", bias=False)
    torch.manual_seed(0)
    attn = Attention(cfg)
    rope = rope_tables(8, 16, cfg.rope_theta)
    x = torch.randn(2, 16, 32)
    results = []
    for backend in ("eager", "sdpa"):
        attn.zero_grad()
        set_attention_backend(attn, backend)
        xi = x.clone().requires_grad_(True)
        out = attn(xi, rope)
        (out * torch.linspace(-1, 1, 32)).sum().backward()
        results.append((out.detach(), xi.grad, attn.wq.weight.grad.clone(),
                        attn.wk.weight.grad.clone()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


MODELS = {
    "gpt2-nano": dict(n_layer=2, n_head=2, d_model=64, seq_len=64, vocab_size=300),
    "llama-nano": dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=64,
                       vocab_size=300, pos_emb="rope", norm="rmsnorm", mlp="swiglu",
                       bias=False, tie_embeddings=False, pad_vocab_to=64),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_full_model_loss_and_grads_agree_between_backends(name):
    cfg = ModelConfig(**MODELS[name])
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (4, 65), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for backend in ("eager", "sdpa"):
        model.zero_grad(set_to_none=True)
        set_attention_backend(model, backend)
        loss = cross_entropy(model(x), y)
        loss.backward()
        results[backend] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (l_eager, g_eager), (l_sdpa, g_sdpa) = results["eager"], results["sdpa"]
    assert l_eager == pytest.approx(l_sdpa, abs=1e-5)
    # A random model predicts about uniformly: the loss is near ln(vocab).
    assert abs(l_eager - math.log(padded_vocab_size(cfg))) < 0.2
    assert g_eager.keys() == g_sdpa.keys()
    for n in g_eager:
        torch.testing.assert_close(g_eager[n], g_sdpa[n], atol=1e-5, rtol=1e-4, msg=n)


def test_flash_on_cpu_is_a_clear_error():
    with pytest.raises(AttentionBackendError) as e:
        resolve_backend("flash", CPU, torch.bfloat16)
    msg = str(e.value)
    assert "model.attention=flash" in msg
    assert "model.attention=sdpa" in msg  # the fix
    assert "CUDA" in msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_on_cpu_resolves_to_sdpa(dtype):
    assert resolve_backend("auto", CPU, dtype) == "sdpa"
    assert resolve_backend("eager", CPU, dtype) == "eager"
    assert resolve_backend("sdpa", CPU, dtype) == "sdpa"


def test_unknown_backend_lists_choices():
    with pytest.raises(AttentionBackendError, match=r"model.attention='xformers'.*sdpa.*eager"):
        resolve_backend("xformers", CPU, torch.float32)


@pytest.mark.parametrize("cc,first", [((9, 0), "CUDNN_ATTENTION"), ((10, 0), "CUDNN_ATTENTION"),
                                      ((8, 0), "FLASH_ATTENTION"), ((8, 9), "FLASH_ATTENTION")])
def test_sdpa_priority_puts_cudnn_first_on_hopper_and_newer(monkeypatch, cc, first):
    from pretrain.model.attention import sdpa_priority

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    order = sdpa_priority(torch.device("cuda", 0))
    assert order[0].name == first and order[-1].name == "MATH"
    assert sdpa_priority(torch.device("cpu")) is None


def test_sdpa_with_a_backend_priority_computes_the_same():
    from torch.nn.attention import SDPBackend

    from pretrain.model.attention import sdpa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g) for _ in range(3))
    order = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    torch.testing.assert_close(sdpa_attention(q, k, v, backends=order), sdpa_attention(q, k, v))
