"""fp8 training of the Linear layers with torchao's float8 (tensorwise or rowwise scaling).

Applied to the plain model before any parallelism, as torchao intends: each eligible
``nn.Linear`` becomes a ``Float8Linear`` whose matmuls run in fp8 with dynamic scales, while
the weights stay in the master dtype. Not converted, and listed in the log: the output head
(its logits feed the loss directly; torchtitan keeps it in bf16 too) and any Linear whose
dimensions are not multiples of 16, which fp8 tensor-core GEMMs require.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.nn as nn

log = logging.getLogger("pretrain")


class Fp8Error(ValueError):
    pass


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    return (isinstance(module, nn.Linear) and not fqn.endswith("lm_head")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(model: nn.Module, recipe: str, fsdp_all_gather: bool) -> tuple[list[str], list[str]]:
    """Convert in place; return (converted, skipped) Linear names. ``fsdp_all_gather``
    all-gathers weights in fp8 under FSDP2 (tensorwise only; needs NCCL)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise Fp8Error("precision=fp8 needs torchao: pip install torchao (or '.[fp8]')") from e
    if recipe not in ("tensorwise", "rowwise"):
        raise Fp8Error(f"precision.fp8_recipe={recipe!r}: use tensorwise or rowwise")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    converted = [n for n, m in linears if fp8_eligible(m, n)]
    skipped = [n for n, m in linears if not fp8_eligible(m, n)]
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_eligible)
    log.info("fp8 (%s): %d Linear layers converted; kept in bf16: %s", recipe, len(converted),
             ", ".join(skipped) or "none")
    return converted, skipped
