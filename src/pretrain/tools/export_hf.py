"""Export a checkpoint as a Hugging Face ``transformers`` model directory.

    python tools/export_hf.py runs/tiny hf/tiny            # newest complete checkpoint of a run
    python tools/export_hf.py runs/tiny/checkpoints/step_0000293 hf/tiny

Writes safetensors weights, config.json, generation_config.json and the tokenizer, loadable
with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``:
GPT2LMHeadModel for the GPT-2 architecture, LlamaForCausalLM for RoPE/RMSNorm/SwiGLU.
The reverse: ``python train.py ... checkpoint.load_weights_only=HF_DIR`` starts a run from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from pretrain.checkpoint.folder import (
    CheckpointError,
    read_meta,
    require_intact,
    resolve_checkpoint,
)
from pretrain.checkpoint.manager import load_model_weights
from pretrain.config.schema import ModelConfig
from pretrain.errors import cli, report
from pretrain.model.gpt import GPT
from pretrain.model.hf import ExportError, hf_config, to_hf_state_dict
from pretrain.precision.policy import DTYPES


def find_tokenizer(ckpt: Path, data: dict) -> Path | None:
    for cand in (ckpt.parent.parent / "tokenizer.json",
                 Path(data.get("root", "data")) / data.get("name", "") / "tokenizer.json"):
        if cand.exists():
            return cand
    return None


def model_from_checkpoint(src: str) -> tuple[GPT, ModelConfig, Path, dict]:
    """(our GPT with the checkpoint's weights, its model config, the step folder, its
    meta.json) of a run, a step folder or a checkpoints folder. Only the model and data
    sections of the saved config are read: the rest may hold keys an older schema had (and
    this one dropped), which a reader of the weights does not need. Its files' sha256 are
    checked against its meta.json first, as resume checks them."""
    ckpt = resolve_checkpoint(src)
    require_intact(ckpt, "Use another checkpoint (a step_XXXXXXX folder of the run).")
    meta = read_meta(ckpt)
    if "config" not in meta:
        raise CheckpointError(f"{ckpt}/meta.json has no config; cannot rebuild the model")
    model_cfg: ModelConfig = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), meta["config"].get("model", {})))
    model = GPT(model_cfg)
    load_model_weights(model, ckpt)
    return model, model_cfg, ckpt, meta


def export(src: str, out: Path, dtype: str = "float32") -> Path:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new output directory")
    model, model_cfg, ckpt, meta = model_from_checkpoint(src)
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    hcfg = hf_config(model_cfg)
    tok_path = find_tokenizer(ckpt, meta["config"].get("data", {}))
    tok = None
    if tok_path is not None:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>")
        hcfg.eos_token_id = hcfg.bos_token_id = tok.eos_token_id
    hf_model = AutoModelForCausalLM.from_config(hcfg)
    hf_model.load_state_dict(to_hf_state_dict(model_cfg, model.state_dict()), strict=True)
    hf_model.to(DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    hf_model.generation_config = GenerationConfig(eos_token_id=hcfg.eos_token_id,
                                                  bos_token_id=hcfg.bos_token_id)
    hf_model.save_pretrained(out, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(out)
    else:
        print(f"warning: no tokenizer.json found for {ckpt}; exported the model only",
              file=sys.stderr)
    (out / "pretrain_meta.json").write_text(
        json.dumps(
            {"checkpoint": str(ckpt), "step": meta.get("step"), "tokens": meta.get("tokens")},
            indent=2,
        )
    )
    return out


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="run directory, checkpoints folder or step_XXXXXXX directory")
    ap.add_argument("out", type=Path, help="output directory (must be new or empty)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = ap.parse_args(argv)
    try:
        out = export(args.source, args.out, args.dtype)
    except (CheckpointError, ExportError, FileExistsError) as e:
        return report(e)
    print(f"exported {args.source} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
