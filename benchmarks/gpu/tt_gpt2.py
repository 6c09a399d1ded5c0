"""torchtitan 0.3.0's Llama 3 at GPT-2 124M's shapes, for a side-by-side on one GPU: a
config_registry module torchtitan loads by its dotted name (``--module tt_gpt2 --config
gpt2_124m``; benchmarks/gpu/torchtitan.sh runs it).

What matches this project's gpt2-124m cell (tools/bench.py, 16 x 1024 x 4): width 768, 12
layers, 12 heads, vocab 50,304, sequence 1,024, 16 sequences a micro batch, 4 micro batches a
step, bf16 compute, torch.compile, no activation checkpointing. What does not (torchtitan's
architecture, kept): RMSNorm for LayerNorm, SwiGLU (hidden 2,048 x 3 matrices) for GELU
(3,072 x 2), RoPE for learned positions, untied output. Parameters: about 124M either way,
counted in its log ("Model ... size"); tokens/s compares, MFU each tool counts its own."""

from __future__ import annotations

import os
from dataclasses import replace

from torchtitan.config import CompileConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models import llama3 as L
from torchtitan.models.llama3 import config_registry as registry

DIM, HEADS, LAYERS, VOCAB = 768, 12, 12, 50304


def _model(attn_backend: str) -> L.Llama3Model.Config:
    return L.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=L.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                          param_init=L._EMBEDDING_INIT),
        norm=L.RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=L.Linear.Config(in_features=DIM, out_features=VOCAB,
                                param_init=L._output_linear_init(DIM)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS,
            hidden_dim=L.compute_ffn_hidden_dim(DIM, multiple_of=256),
            rope=L.ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=131072, theta=500000,
                                      scaling="llama"),
            attn_backend=attn_backend))


def gpt2_124m():
    """llama3_debugmodel's trainer config with the model, batch and data above; the data
    and tokenizer from $TT_DATA and $TT_ASSETS (torchtitan.sh makes both, no network)."""
    cfg = registry.llama3_debugmodel()
    backend = os.environ.get("TT_ATTENTION", "flex")
    cfg.model_spec = replace(L.model_registry("debugmodel", attn_backend=backend),
                             flavor="gpt2_124m", model=_model(backend))
    cfg.loss.loss_fn.global_vocab_size = VOCAB
    cfg.hf_assets_path = os.environ["TT_ASSETS"]
    cfg.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                      dataset_path=os.environ["TT_DATA"])
    cfg.training.local_batch_size = 16
    cfg.training.global_batch_size = 64  # 4 micro batches a step on one GPU
    cfg.training.seq_len = 1024
    cfg.training.steps = int(os.environ.get("TT_STEPS", "30"))
    cfg.activation_checkpoint = None
    cfg.compile = CompileConfig(enable=True)
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.metrics.log_freq = 1
    return cfg
