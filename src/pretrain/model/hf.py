"""Conversion between this project's GPT and Hugging Face ``transformers`` models.

Two architectures map one to one:

- GPT-2 (learned positions, LayerNorm, GELU-tanh, tied embeddings, biases, MHA)
  <-> ``GPT2LMHeadModel``. GPT-2 keeps Q, K, V in one ``Conv1D`` (weights stored
  transposed, as (in, out)).
- LLaMA style (RoPE with the rotate-half convention, RMSNorm, SwiGLU, optional GQA,
  biases off) <-> ``LlamaForCausalLM``. Our MLP is w2(silu(w1 x) * w3 x): w1 is HF's
  gate_proj, w3 its up_proj, w2 its down_proj.
- The same with a mixture of experts in every layer <-> ``MixtralForCausalLM`` (top-k
  weights renormalised, no QK-norm) or ``OlmoeForCausalLM`` (QK-norm, not renormalised).
  The router is HF's ``mlp.gate``; our experts' w1 and w3 stacked are its
  ``experts.gate_up_proj`` (experts x 2 hidden x d), w2 its ``experts.down_proj``.

The exported vocabulary is the tokenizer's (``model.vocab_size``), without padding rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.config.schema import ModelConfig
from pretrain.errors import UserError
from pretrain.model.parametrization import fold_into_weights


class ExportError(UserError, ValueError):
    pass


def architecture(cfg: ModelConfig) -> str:
    if (cfg.pos_emb, cfg.norm, cfg.mlp) == ("learned", "layernorm", "gelu"):
        if not cfg.bias or not cfg.tie_embeddings or (cfg.n_kv_head or cfg.n_head) != cfg.n_head:
            raise ExportError("GPT-2 export needs model.bias=true, model.tie_embeddings=true and "
                              "no grouped-query attention (model.n_kv_head=null)")
        return "gpt2"
    if (cfg.pos_emb, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu"):
        return _llama_family(cfg)
    raise ExportError(
        f"no transformers architecture matches pos_emb={cfg.pos_emb}, norm={cfg.norm}, "
        f"mlp={cfg.mlp}: export supports GPT-2 (learned, layernorm, gelu) and LLaMA "
        "(rope, rmsnorm, swiglu)"
    )


def _llama_family(cfg: ModelConfig) -> str:
    if not cfg.moe_experts:
        if cfg.qk_norm:
            raise ExportError("a dense model with model.qk_norm has no transformers "
                              "architecture here (export supports QK-norm with experts: OLMoE)")
        return "llama"
    unsupported = [f"{k}={getattr(cfg, k)}" for k, ok in (
        ("moe_shared_experts", not cfg.moe_shared_experts),
        ("moe_first_dense", not cfg.moe_first_dense), ("bias", not cfg.bias),
        ("moe_balance", cfg.moe_balance != "aux_free")) if not ok]
    if unsupported:  # aux_free: HF routes without the selection bias
        raise ExportError("Mixtral/OLMoE export needs an MoE in every layer, no shared "
                          "experts, no biases and no aux_free selection bias; this model has "
                          + ", ".join(unsupported))
    if cfg.qk_norm != (not cfg.moe_norm_topk):
        raise ExportError("MoE export: Mixtral renormalises the top-k weights without "
                          "QK-norm (model.moe_norm_topk=true, qk_norm=false), OLMoE has "
                          "QK-norm without it (moe_norm_topk=false, qk_norm=true)")
    return "olmoe" if cfg.qk_norm else "mixtral"


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
    from pretrain.model.gpt import expert_dim, ffn_dim

    if architecture(cfg) in ("mixtral", "olmoe"):
        from transformers import MixtralConfig, OlmoeConfig

        common = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
            intermediate_size=expert_dim(cfg), num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head or cfg.n_head,
            max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_std, num_experts_per_tok=cfg.moe_top_k,
            router_aux_loss_coef=cfg.moe_aux_coeff, hidden_act="silu")
        if architecture(cfg) == "mixtral":
            return MixtralConfig(**common, num_local_experts=cfg.moe_experts,
                                 head_dim=cfg.d_model // cfg.n_head,
                                 architectures=["MixtralForCausalLM"])
        return OlmoeConfig(**common, num_experts=cfg.moe_experts, norm_topk_prob=False,
                           attention_bias=False, clip_qkv=None,
                           architectures=["OlmoeForCausalLM"])
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
                 ("self_attn.v_proj", "attn.wv"), ("self_attn.o_proj", "attn.wo")]
        names += ([("mlp.gate", "moe.router")] if cfg.moe_experts else
                  [("mlp.gate_proj", "mlp.w1"), ("mlp.up_proj", "mlp.w3"),
                   ("mlp.down_proj", "mlp.w2")])
        for hf_n, ours in names:
            yield h + hf_n + ".weight", o + ours + ".weight"
            if cfg.bias:
                yield h + hf_n + ".bias", o + ours + ".bias"
        if cfg.qk_norm:
            yield h + "self_attn.q_norm.weight", o + "attn.q_norm.weight"
            yield h + "self_attn.k_norm.weight", o + "attn.k_norm.weight"
        yield h + "input_layernorm.weight", o + "attn_norm.weight"
        yield h + "post_attention_layernorm.weight", o + "mlp_norm.weight"
    yield "model.norm.weight", "norm.weight"
    if not cfg.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight"


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (full, unsharded) state dict -> the transformers model's state dict. muP's and
    CompleteP's multipliers are folded into the weights (``fold_into_weights``): the
    transformers model computes the same logits with its own plain forward."""
    sd = fold_into_weights(cfg, sd)
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
        for i in range(cfg.n_layer if cfg.moe_experts else 0):
            e, h = f"layers.{i}.moe.experts.", f"model.layers.{i}.mlp.experts."
            out[h + "gate_up_proj"] = torch.cat([sd[e + "w1"], sd[e + "w3"]], dim=1)
            out[h + "down_proj"] = sd[e + "w2"]
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
        for i in range(cfg.n_layer if cfg.moe_experts else 0):
            e, h = f"layers.{i}.moe.experts.", f"model.layers.{i}.mlp.experts."
            sd[e + "w1"], sd[e + "w3"] = hf[h + "gate_up_proj"].chunk(2, dim=1)
            sd[e + "w2"] = hf[h + "down_proj"]
        sd["tok_emb.weight"] = pad(sd["tok_emb.weight"])
        sd["lm_head.weight"] = (sd["tok_emb.weight"] if cfg.tie_embeddings
                                else pad(sd["lm_head.weight"]))
    sd = fold_into_weights(cfg, sd, inverse=True)
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
    if kind not in ("llama", "mixtral", "olmoe"):
        raise ExportError(f"cannot import a transformers model of type {kind!r}: gpt2, llama, "
                          "mixtral and olmoe are supported")
    fields = dict(n_layer=hf_cfg.num_hidden_layers, n_head=hf_cfg.num_attention_heads,
                  n_kv_head=hf_cfg.num_key_value_heads, d_model=hf_cfg.hidden_size,
                  vocab_size=hf_cfg.vocab_size, seq_len=hf_cfg.max_position_embeddings,
                  norm_eps=hf_cfg.rms_norm_eps,
                  rope_theta=float(getattr(hf_cfg, "rope_theta", None)
                                   or hf_cfg.rope_parameters["rope_theta"]),
                  pos_emb="rope", norm="rmsnorm", mlp="swiglu",
                  bias=bool(getattr(hf_cfg, "attention_bias", False)),
                  tie_embeddings=bool(hf_cfg.tie_word_embeddings))
    if kind == "llama":
        return {**fields, "d_ff": hf_cfg.intermediate_size}
    experts = hf_cfg.num_local_experts if kind == "mixtral" else hf_cfg.num_experts
    return {**fields, "moe_experts": experts, "moe_top_k": hf_cfg.num_experts_per_tok,
            "moe_d_ff": hf_cfg.intermediate_size, "qk_norm": kind == "olmoe",
            "moe_norm_topk": kind == "mixtral" or bool(hf_cfg.norm_topk_prob)}


def check_matches(cfg: ModelConfig, hf_cfg) -> None:
    """Raise naming every model.* key that differs from the transformers checkpoint."""
    want = model_config_from_hf(hf_cfg)
    from pretrain.model.gpt import ffn_dim

    have = {k: getattr(cfg, k) for k in want}
    if "d_ff" in want and want["d_ff"] is None:
        want.pop("d_ff")
        have.pop("d_ff")
    elif "d_ff" in want:
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
    if cfg.moe_experts:
        tensors = _stack_experts(tensors, cfg)
    return {k: t.float() for k, t in tensors.items()}


# One expert's matrices in the published checkpoints' per-expert layout: (gate, up, down).
_EXPERT_FILES = {"mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                             "block_sparse_moe.experts.{e}.w2"),
                 "olmoe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                           "mlp.experts.{e}.down_proj")}


def _stack_experts(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Mixtral's and OLMoE's files keep one matrix per expert (what save_pretrained writes
    too): stacked here into transformers' in-memory layout, which the mapping reads."""
    gate, up, down = _EXPERT_FILES[architecture(cfg)]
    out = dict(tensors)
    for i in range(cfg.n_layer):
        h = f"model.layers.{i}."
        if h + gate.format(e=0) + ".weight" not in out:
            continue  # already stacked
        take = [[out.pop(h + name.format(e=e) + ".weight") for e in range(cfg.moe_experts)]
                for name in (gate, up, down)]
        out[h + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(take[0], take[1], strict=True)])
        out[h + "mlp.experts.down_proj"] = torch.stack(take[2])
        router = h + "block_sparse_moe.gate.weight"
        if router in out:
            out[h + "mlp.gate.weight"] = out.pop(router)
    return out


def load_hf_weights(model: torch.nn.Module, cfg: ModelConfig, path: str) -> None:
    """Initialise ``model`` (plain, unsharded) from a transformers checkpoint directory."""
    from transformers import AutoConfig

    from pretrain.model.gpt import padded_vocab_size

    check_matches(cfg, AutoConfig.from_pretrained(path))
    sd = from_hf_state_dict(cfg, read_hf_weights(Path(path), cfg), padded_vocab_size(cfg))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in sd:
                tensor.copy_(sd[name])
