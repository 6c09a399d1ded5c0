"""Conversion between this project's GPT and Hugging Face ``transformers`` models.

Two architectures map one to one:

- GPT-2 (learned positions, LayerNorm, GELU-tanh, tied embeddings, biases, MHA)
  <-> ``GPT2LMHeadModel``. GPT-2 keeps Q, K, V in one ``Conv1D`` (weights stored
  transposed, as (in, out)).
- LLaMA style (RoPE with the rotate-half convention, RMSNorm, SwiGLU, optional GQA,
  biases off) <-> ``LlamaForCausalLM``. Our MLP is w2(silu(w1 x) * w3 x): w1 is HF's
  gate_proj, w3 its up_proj, w2 its down_proj.

The exported vocabulary is the tokenizer's (``model.vocab_size``), without padding rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.config import ModelConfig


class ExportError(ValueError):
    pass


def architecture(cfg: ModelConfig) -> str:
    if (cfg.pos_emb, cfg.norm, cfg.mlp) == ("learned", "layernorm", "gelu"):
        if not cfg.bias or not cfg.tie_embeddings or (cfg.n_kv_head or cfg.n_head) != cfg.n_head:
            raise ExportError("GPT-2 export needs model.bias=true, model.tie_embeddings=true and "
                              "no grouped-query attention (model.n_kv_head=null)")
        return "gpt2"
    if (cfg.pos_emb, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu"):
        return "llama"
    raise ExportError(
        f"no transformers architecture matches pos_emb={cfg.pos_emb}, norm={cfg.norm}, "
        f"mlp={cfg.mlp}: export supports GPT-2 (learned, layernorm, gelu) and LLaMA "
        "(rope, rmsnorm, swiglu)"
    )


def hf_config(cfg: ModelConfig):
    """The transformers config of the same model."""
    from transformers import GPT2Config, LlamaConfig

    if architecture(cfg) == "gpt2":
        return GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
            n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.d_ff,
            activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            initializer_range=cfg.init_std, tie_word_embeddings=True,
            architectures=["GPT2LMHeadModel"],
        )
    from pretrain.model import ffn_dim

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=ffn_dim(cfg),
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head or cfg.n_head, head_dim=cfg.d_model // cfg.n_head,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        hidden_act="silu", architectures=["LlamaForCausalLM"],
    )


def _gpt2_pairs(cfg: ModelConfig):
    """(hf name, our names, transpose) for every GPT-2 tensor but c_attn."""
    yield "transformer.wte.weight", "tok_emb.weight", False
    yield "transformer.wpe.weight", "pos_emb.weight", False
    for i in range(cfg.n_layer):
        h, o = f"transformer.h.{i}.", f"layers.{i}."
        for hf_n, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            yield h + hf_n + ".weight", o + ours + ".weight", False
            yield h + hf_n + ".bias", o + ours + ".bias", False
        for hf_n, ours in (("attn.c_proj", "attn.wo"), ("mlp.c_fc", "mlp.w1"),
                           ("mlp.c_proj", "mlp.w2")):
            yield h + hf_n + ".weight", o + ours + ".weight", True
            yield h + hf_n + ".bias", o + ours + ".bias", False
    yield "transformer.ln_f.weight", "norm.weight", False
    yield "transformer.ln_f.bias", "norm.bias", False


def _llama_pairs(cfg: ModelConfig):
    yield "model.embed_tokens.weight", "tok_emb.weight"
    for i in range(cfg.n_layer):
        h, o = f"model.layers.{i}.", f"layers.{i}."
        names = [("self_attn.q_proj", "attn.wq"), ("self_attn.k_proj", "attn.wk"),
                 ("self_attn.v_proj", "attn.wv"), ("self_attn.o_proj", "attn.wo"),
                 ("mlp.gate_proj", "mlp.w1"), ("mlp.up_proj", "mlp.w3"),
                 ("mlp.down_proj", "mlp.w2")]
        for hf_n, ours in names:
            yield h + hf_n + ".weight", o + ours + ".weight"
            if cfg.bias:
                yield h + hf_n + ".bias", o + ours + ".bias"
        yield h + "input_layernorm.weight", o + "attn_norm.weight"
        yield h + "post_attention_layernorm.weight", o + "mlp_norm.weight"
    yield "model.norm.weight", "norm.weight"
    if not cfg.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight"


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (full, unsharded) state dict -> the transformers model's state dict."""
    v = cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    unpad = {"tok_emb.weight", "lm_head.weight"}
    if architecture(cfg) == "gpt2":
        for hf_n, ours, transpose in _gpt2_pairs(cfg):
            t = sd[ours][:v] if ours in unpad else sd[ours]
            out[hf_n] = t.t() if transpose else t
        for i in range(cfg.n_layer):
            a = f"layers.{i}.attn."
            out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
                [sd[a + "wq.weight"], sd[a + "wk.weight"], sd[a + "wv.weight"]]).t()
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat(
                [sd[a + "wq.bias"], sd[a + "wk.bias"], sd[a + "wv.bias"]])
        out["lm_head.weight"] = out["transformer.wte.weight"]
    else:
        for hf_n, ours in _llama_pairs(cfg):
            out[hf_n] = sd[ours][:v] if ours in unpad else sd[ours]
        if cfg.tie_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: t.detach().contiguous() for k, t in out.items()}


def from_hf_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor],
                       padded_vocab: int) -> dict[str, torch.Tensor]:
    """A transformers state dict -> ours (padding rows, if any, are zero)."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == padded_vocab:
            return t
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])

    sd: dict[str, torch.Tensor] = {}
    if architecture(cfg) == "gpt2":
        for hf_n, ours, transpose in _gpt2_pairs(cfg):
            sd[ours] = hf[hf_n].t() if transpose else hf[hf_n]
        d, kv = cfg.d_model, (cfg.d_model // cfg.n_head) * cfg.n_head
        for i in range(cfg.n_layer):
            w = hf[f"transformer.h.{i}.attn.c_attn.weight"].t()
            b = hf[f"transformer.h.{i}.attn.c_attn.bias"]
            for j, name in enumerate(("wq", "wk", "wv")):
                sd[f"layers.{i}.attn.{name}.weight"] = w[j * kv:(j + 1) * kv, :d]
                sd[f"layers.{i}.attn.{name}.bias"] = b[j * kv:(j + 1) * kv]
        sd["tok_emb.weight"] = pad(sd["tok_emb.weight"])
        sd["lm_head.weight"] = sd["tok_emb.weight"]
    else:
        for hf_n, ours in _llama_pairs(cfg):
            sd[ours] = hf[hf_n]
        sd["tok_emb.weight"] = pad(sd["tok_emb.weight"])
        sd["lm_head.weight"] = (sd["tok_emb.weight"] if cfg.tie_embeddings
                                else pad(sd["lm_head.weight"]))
    return {k: t.contiguous() for k, t in sd.items()}


def model_config_from_hf(hf_cfg) -> dict:
    """ModelConfig fields for a transformers GPT-2 or Llama config."""
    kind = getattr(hf_cfg, "model_type", None)
    if kind == "gpt2":
        return dict(n_layer=hf_cfg.n_layer, n_head=hf_cfg.n_head, d_model=hf_cfg.n_embd,
                    d_ff=hf_cfg.n_inner, vocab_size=hf_cfg.vocab_size,
                    seq_len=hf_cfg.n_positions, norm_eps=hf_cfg.layer_norm_epsilon,
                    pos_emb="learned", norm="layernorm", mlp="gelu", bias=True,
                    tie_embeddings=True, n_kv_head=None)
    if kind == "llama":
        return dict(n_layer=hf_cfg.num_hidden_layers, n_head=hf_cfg.num_attention_heads,
                    n_kv_head=hf_cfg.num_key_value_heads, d_model=hf_cfg.hidden_size,
                    d_ff=hf_cfg.intermediate_size, vocab_size=hf_cfg.vocab_size,
                    seq_len=hf_cfg.max_position_embeddings, norm_eps=hf_cfg.rms_norm_eps,
                    rope_theta=float(getattr(hf_cfg, "rope_theta", None)
                                     or hf_cfg.rope_parameters["rope_theta"]),
                    pos_emb="rope", norm="rmsnorm", mlp="swiglu",
                    bias=bool(hf_cfg.attention_bias),
                    tie_embeddings=bool(hf_cfg.tie_word_embeddings))
    raise ExportError(f"cannot import a transformers model of type {kind!r}: gpt2 and llama are "
                      "supported")


def check_matches(cfg: ModelConfig, hf_cfg) -> None:
    """Raise naming every model.* key that differs from the transformers checkpoint."""
    want = model_config_from_hf(hf_cfg)
    from pretrain.model import ffn_dim

    have = {k: getattr(cfg, k) for k in want}
    if want.get("d_ff") is None:
        want.pop("d_ff")
        have.pop("d_ff")
    else:
        have["d_ff"] = ffn_dim(cfg)
    have["n_kv_head"] = cfg.n_kv_head or cfg.n_head
    if want.get("n_kv_head") is None:
        want["n_kv_head"] = want["n_head"]
    diff = [f"model.{k}={have[k]!r} (checkpoint has {v!r})" for k, v in want.items()
            if have[k] != v and not (isinstance(v, float) and abs(have[k] - v) < 1e-12)]
    if diff:
        fix = " ".join(f"model.{k}={v}" for k, v in want.items()
                       if have[k] != v and v is not None)
        raise ExportError("the model config does not match the transformers checkpoint: "
                          + "; ".join(diff) + f". Override: {fix}")


def read_hf_weights(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The float32 tensors of a transformers checkpoint directory, straight from its
    safetensors file or the shards its index lists: no transformers model is built to hold
    them. A base-model checkpoint (GPT-2 as published: ``h.0...``, no ``transformer.``)
    gets the causal-LM prefix that ``from_hf_state_dict`` reads."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{path} has no model.safetensors or model.safetensors.index.json: "
                          "save the model with save_pretrained(..., safe_serialization=True)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name))
    prefix = "transformer." if architecture(cfg) == "gpt2" else "model."
    if not any(k.startswith(prefix) for k in tensors):
        tensors = {(k if k == "lm_head.weight" else prefix + k): t for k, t in tensors.items()}
    return {k: t.float() for k, t in tensors.items()}


def load_hf_weights(model: torch.nn.Module, cfg: ModelConfig, path: str) -> None:
    """Initialise ``model`` (plain, unsharded) from a transformers checkpoint directory."""
    from transformers import AutoConfig

    from pretrain.model import padded_vocab_size

    check_matches(cfg, AutoConfig.from_pretrained(path))
    sd = from_hf_state_dict(cfg, read_hf_weights(Path(path), cfg), padded_vocab_size(cfg))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in sd:
                tensor.copy_(sd[name])
