"""A sample of generated text from the trained model at the end of a run
(``train.sample_tokens``; 0: none), on the loop's seam."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")


def sample(module, train_cfg, tokenizer: Path, device: torch.device) -> str | None:
    """``train.sample_tokens`` tokens generated from ``train.sample_prompt`` by the trained
    model (None when not asked for, or the layout splits the model)."""
    if train_cfg.sample_tokens <= 0:
        return None
    model, why_not = module.generator_model()
    if model is None:
        log.info("sampling skipped: %s", why_not)
        return None
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    prompt = tok(train_cfg.sample_prompt, add_special_tokens=False)["input_ids"] or [0]
    model.eval()
    # Same seed on every rank: data-parallel replicas draw the same tokens in lockstep.
    gen = torch.Generator(device=device).manual_seed(train_cfg.seed)
    with module.autocast():  # the compute dtype training ran in
        out = model.generate(
            torch.tensor([prompt], device=device), train_cfg.sample_tokens,
            temperature=train_cfg.sample_temperature, top_k=train_cfg.sample_top_k,
            generator=gen)
    return tok.decode(out[0].tolist())


@register(order=70)
class SampleHook(Hook):
    """``sample`` at the end of a run: logged, and in result.json as ``sample``. Every
    rank generates (data-parallel replicas in lockstep)."""

    name = "sample"

    def finish(self, ctx: LoopContext) -> None:
        text = sample(ctx.module, ctx.cfg.train, ctx.tokenizer, ctx.device)
        if text is not None:
            log.info("sample from the trained model:\n%s\n%s\n%s", "-" * 60, text, "-" * 60)
            ctx.record("sample", text)
