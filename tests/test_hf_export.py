"""Export to transformers and back: same logits, same greedy tokens, both architectures."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pretrain.checkpoint.manager import CheckpointManager
from pretrain.checkpoint.model_state import ModelOptimizer
from pretrain.config.schema import CheckpointConfig, Config, ModelConfig
from pretrain.model.gpt import GPT
from pretrain.model.hf import ExportError, check_matches, hf_config, load_hf_weights
from pretrain.tools.export_hf import main as export_main

REPO = Path(__file__).resolve().parents[1]

GPT2 = ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=300,
                   pad_vocab_to=64, attention="eager")
LLAMA = dataclasses.replace(GPT2, n_kv_head=2, pos_emb="rope", norm="rmsnorm", mlp="swiglu",
                            bias=False, tie_embeddings=False, d_ff=96)

MIXTRAL = dataclasses.replace(LLAMA, moe_experts=4, moe_top_k=2, moe_d_ff=48)
OLMOE = dataclasses.replace(MIXTRAL, n_kv_head=None, qk_norm=True, moe_norm_topk=False)
# muP and CompleteP at a width and depth other than their bases: every multiplier (output,
# 1/d_head attention, 1/L residual branches) is not 1 and must be folded into the weights
# (GPT2_MUP's output multiplier with the base's output_mult too).
GPT2_MUP = dataclasses.replace(GPT2, parametrization="mup", base_width=32, output_mult=3.0)
LLAMA_COMPLETEP = dataclasses.replace(LLAMA, parametrization="completep", base_width=16,
                                      base_depth=1)
OLMOE_COMPLETEP = dataclasses.replace(OLMOE, parametrization="completep", base_width=128,
                                      base_depth=4)


def random_model(cfg: ModelConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():  # make norms and biases matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_run(tmp_path, cfg: ModelConfig, model: GPT):
    run = tmp_path / "run"
    config = OmegaConf.to_container(OmegaConf.structured(Config(model=cfg)))
    mgr = CheckpointManager(run / "checkpoints", CheckpointConfig(enabled=True))
    mgr.save(5, {"model_optim": ModelOptimizer(model, None)}, {"step": 5, "config": config},
             block=True)
    # The tokenizer the run trained on; a byte-level BPE of the model's vocabulary size.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the cat sees a dog. " * 50], trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(run / "tokenizer.json"))
    return run


@pytest.mark.parametrize("cfg,arch", [(GPT2, "GPT2LMHeadModel"), (LLAMA, "LlamaForCausalLM"),
                                      (MIXTRAL, "MixtralForCausalLM"),
                                      (OLMOE, "OlmoeForCausalLM"),
                                      (GPT2_MUP, "GPT2LMHeadModel"),
                                      (LLAMA_COMPLETEP, "LlamaForCausalLM"),
                                      (OLMOE_COMPLETEP, "OlmoeForCausalLM")],
                         ids=["gpt2", "llama", "mixtral", "olmoe", "gpt2-mup",
                              "llama-completep", "olmoe-completep"])
def test_export_parity(tmp_path, cfg, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = random_model(cfg).eval()
    run = save_run(tmp_path, cfg, model)
    out = tmp_path / "hf"
    # tools/export_hf.py's main, in this process (a fresh interpreter importing torch and
    # transformers costs more than the check; test_export_refuses_non_empty_output runs the
    # script itself)
    assert export_main([str(run), str(out)]) == 0
    assert (out / "model.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == arch
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>" and 0 < len(tok) <= cfg.vocab_size

    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        ours = model(x)[..., : cfg.vocab_size]
        theirs = hf(x).logits
    assert (ours - theirs).abs().max().item() < 1e-4

    prompt = x[:1, :4]
    ours_gen = model.generate(prompt, 12, temperature=0)
    # no end-of-text token: greedy decoding may pick it (0 here), ours does not stop there
    from transformers import GenerationConfig

    theirs_gen = hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                             generation_config=GenerationConfig(
                                 max_new_tokens=12, do_sample=False, pad_token_id=0))
    # HF stops at the end-of-text token (greedy may pick it, id 0 here); ours runs on
    n = theirs_gen.shape[1]
    assert ours_gen[:, :n].tolist() == theirs_gen.tolist()
    assert n == ours_gen.shape[1] or theirs_gen[0, -1] == tok.eos_token_id

    # And back: a transformers directory initialises our model to the same function.
    back = GPT(cfg)
    load_hf_weights(back, cfg, str(out))
    with torch.no_grad():
        assert (back(x)[..., : cfg.vocab_size] - ours).abs().max().item() < 1e-5


def test_export_refuses_non_empty_output(tmp_path):
    run = save_run(tmp_path, GPT2, random_model(GPT2))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "export_hf.py"), str(run), str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_unsupported_architecture_and_mismatch_are_clear():
    with pytest.raises(ExportError, match="pos_emb=rope, norm=layernorm"):
        hf_config(dataclasses.replace(GPT2, pos_emb="rope"))
    with pytest.raises(ExportError, match=r"model\.n_layer=3 \(checkpoint has 2\)"):
        check_matches(dataclasses.replace(GPT2, n_layer=3), hf_config(GPT2))


def test_one_dtype_table_for_policies_planner_and_export():
    """pretrain-export-hf's --dtype, the precision policy and the planner's bytes per element
    read one table: the export offers exactly its names, and the planner counts the bytes
    torch allocates for each."""
    from pretrain.config.schema import ParallelConfig, PrecisionConfig
    from pretrain.parallel.layout import resolve_layout
    from pretrain.planning.memory import activation_setup
    from pretrain.precision.policy import DTYPES, dtype_bytes
    from pretrain.tools import export_hf as tool

    assert tool.DTYPES is DTYPES
    assert {n: dtype_bytes(n) for n in DTYPES} == {
        n: torch.empty(0, dtype=d).element_size() for n, d in DTYPES.items()}
    cfg = Config()
    cfg.parallel = ParallelConfig(dp=1)
    for name in DTYPES:
        cfg.precision = PrecisionConfig(compute_dtype=name)
        a = activation_setup(cfg, resolve_layout(cfg, 1))
        assert a.compute_bytes == torch.empty(0, dtype=DTYPES[name]).element_size()
