"""Model presets have the published parameter counts (GPT-2 exactly, GPT-3 within 2%)."""

from __future__ import annotations

import pytest
import torch
from helpers import CONF_DIR
from omegaconf import OmegaConf

from pretrain.budget import count_params
from pretrain.config import ModelConfig


def load_model_config(name: str) -> ModelConfig:
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                           OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(node)


GPT2 = {  # preset: (published count of the released checkpoint, n_layer, n_head, d_model)
    "gpt2-124m": (124_439_808, 12, 12, 768),
    "gpt2-355m": (354_823_168, 24, 16, 1024),
    "gpt2-774m": (774_030_080, 36, 20, 1280),
    "gpt2-1.5b": (1_557_611_200, 48, 25, 1600),
}


@pytest.mark.parametrize("preset", list(GPT2))
def test_gpt2_presets_match_published_and_transformers(preset):
    from transformers import GPT2Config, GPT2LMHeadModel

    published, n_layer, n_head, d_model = GPT2[preset]
    cfg = load_model_config(preset)
    assert (cfg.n_layer, cfg.n_head, cfg.d_model) == (n_layer, n_head, d_model)
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=d_model,
                                        n_positions=1024, vocab_size=50257))
    hf_count = sum(p.numel() for p in hf.parameters())
    counts = count_params(cfg)
    assert hf_count == published
    assert counts.total == published
    # Non-embedding: minus the token (50257 x d) and position (1024 x d) tables.
    assert counts.non_embedding == published - 50257 * d_model - 1024 * d_model


# Brown et al. 2020, Table 2.1, "n_params".
GPT3 = {
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9,
}


@pytest.mark.parametrize("preset", list(GPT3))
def test_gpt3_presets_within_two_percent_of_table_2_1(preset):
    cfg = load_model_config(preset)
    assert cfg.seq_len == 2048
    total = count_params(cfg).total
    assert abs(total - GPT3[preset]) / GPT3[preset] < 0.02, f"{preset}: {total:,}"


def test_gpt3_175b_count_by_hand():
    # 96 blocks of 12 d^2 + 13 d (four d x d attention matrices and two d x 4d MLP matrices,
    # with biases, two LayerNorms), a final LayerNorm, token and position tables.
    d, n_layer = 12288, 96
    expected = n_layer * (12 * d * d + 13 * d) + 2 * d + 50257 * d + 2048 * d
    counts = count_params(load_model_config("gpt3-175b"))
    assert counts.total == expected
    assert counts.non_embedding == expected - 50257 * d - 2048 * d


def test_untied_padded_vocab_counts():
    # Untied: the output head is its own 320 x 64 matrix (300 rounded up to a multiple of 64).
    cfg = load_model_config("nano")
    cfg.vocab_size, cfg.pad_vocab_to, cfg.tie_embeddings = 300, 64, False
    tied = load_model_config("nano")
    tied.vocab_size, tied.pad_vocab_to = 300, 64
    untied_counts, tied_counts = count_params(cfg), count_params(tied)
    assert untied_counts.total - tied_counts.total == 320 * 64
    # non-embedding excludes the token (320 x 64) and position (64 x 64) tables only.
    assert untied_counts.non_embedding == untied_counts.total - 320 * 64 - 64 * 64
