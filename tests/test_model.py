"""The default model is GPT-2: loaded with a transformers GPT-2's weights it gives its logits."""

from __future__ import annotations

import pytest
import torch

from pretrain.config.schema import ModelConfig
from pretrain.model.gpt import GPT, ffn_dim, padded_vocab_size

N_LAYER, N_HEAD, D_MODEL, SEQ, VOCAB = 2, 4, 64, 32, 300


def hf_gpt2(tie: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=N_LAYER, n_head=N_HEAD, n_embd=D_MODEL, n_positions=SEQ,
                     vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie,
                     attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).eval()
    # HF initialises biases to zero and norms to one; perturb everything so that a wrong
    # mapping of any tensor (a bias, a LayerNorm, a transposition) changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def gpt2_to_ours(hf) -> dict[str, torch.Tensor]:
    """Map transformers' GPT-2 names to ours. Conv1D stores weights as (in, out)."""
    sd = hf.state_dict()
    out = {
        "tok_emb.weight": sd["transformer.wte.weight"],
        "pos_emb.weight": sd["transformer.wpe.weight"],
        "norm.weight": sd["transformer.ln_f.weight"],
        "norm.bias": sd["transformer.ln_f.bias"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(N_LAYER):
        h, o = f"transformer.h.{i}.", f"layers.{i}."
        wq, wk, wv = sd[h + "attn.c_attn.weight"].t().chunk(3, dim=0)
        bq, bk, bv = sd[h + "attn.c_attn.bias"].chunk(3, dim=0)
        out.update(
            {
                o + "attn_norm.weight": sd[h + "ln_1.weight"],
                o + "attn_norm.bias": sd[h + "ln_1.bias"],
                o + "attn.wq.weight": wq,
                o + "attn.wq.bias": bq,
                o + "attn.wk.weight": wk,
                o + "attn.wk.bias": bk,
                o + "attn.wv.weight": wv,
                o + "attn.wv.bias": bv,
                o + "attn.wo.weight": sd[h + "attn.c_proj.weight"].t(),
                o + "attn.wo.bias": sd[h + "attn.c_proj.bias"],
                o + "mlp_norm.weight": sd[h + "ln_2.weight"],
                o + "mlp_norm.bias": sd[h + "ln_2.bias"],
                o + "mlp.w1.weight": sd[h + "mlp.c_fc.weight"].t(),
                o + "mlp.w1.bias": sd[h + "mlp.c_fc.bias"],
                o + "mlp.w2.weight": sd[h + "mlp.c_proj.weight"].t(),
                o + "mlp.w2.bias": sd[h + "mlp.c_proj.bias"],
            }
        )
    return {k: v.contiguous() for k, v in out.items()}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_transformers_gpt2(tie, backend):
    from pretrain.model.gpt import set_attention_backend

    hf = hf_gpt2(tie)
    ours = GPT(ModelConfig(n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, seq_len=SEQ,
                           vocab_size=VOCAB, tie_embeddings=tie)).eval()
    missing, unexpected = ours.load_state_dict(gpt2_to_ours(hf), strict=True)
    assert not missing and not unexpected
    if tie:
        assert ours.lm_head.weight.data_ptr() == ours.tok_emb.weight.data_ptr()
    set_attention_backend(ours, backend)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape == (3, SEQ, VOCAB)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_padded_vocab_and_ffn_width():
    cfg = ModelConfig(vocab_size=50257, pad_vocab_to=128, d_model=2048, mlp="swiglu",
                      ffn_multiple_of=256)
    assert padded_vocab_size(cfg) == 50304
    # LLaMA rule: 8/3 * 2048 = 5461.3 rounded up to a multiple of 256.
    assert ffn_dim(cfg) == 5632
    assert ffn_dim(ModelConfig(d_model=768)) == 3072


def test_init_weights_gpt2_statistics():
    """N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 L), zero biases."""
    cfg = ModelConfig(n_layer=8, n_head=4, d_model=256, seq_len=64, vocab_size=1000)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    torch.manual_seed(0)
    model.init_weights()
    assert model.lm_head.weight is model.tok_emb.weight
    w1 = torch.cat([b.mlp.w1.weight.flatten() for b in model.layers.values()])
    w2 = torch.cat([b.mlp.w2.weight.flatten() for b in model.layers.values()])
    assert w1.std().item() == pytest.approx(0.02, rel=0.02)
    assert w2.std().item() == pytest.approx(0.02 / 4.0, rel=0.02)  # 1/sqrt(2*8) = 1/4
    assert all(b.attn.wq.bias.abs().max() == 0 for b in model.layers.values())
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_padded_rows_never_sampled():
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=50,
                      pad_vocab_to=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        # The final norm outputs e_0 whatever the input, so row r's logit is W[r, 0]:
        # make the padded rows (50..63) by far the most likely.
        model.norm.weight.zero_()
        model.norm.bias.zero_()
        model.norm.bias[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[50:, 0] = 20.0
        assert model(torch.zeros(1, 4, dtype=torch.long))[0, -1].argmax().item() >= 50
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 20, temperature=1.0)
    assert out.shape == (1, 21)
    assert out.max().item() < 50
