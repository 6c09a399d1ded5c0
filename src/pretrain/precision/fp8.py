"""fp8 training of the Linear layers with torchao's float8 (tensorwise or rowwise scaling).

Applied to the plain (meta-device) model before any parallelism, as torchao and torchtitan
do: each eligible ``nn.Linear`` becomes a ``Float8Linear`` whose three matmuls (forward,
grad-input, grad-weight) run in fp8 with dynamic scales, while the weights, gradients and
optimizer state stay in the master dtype. Parameter names do not change, so checkpoints
move freely between fp8 and bf16 runs.

Not converted, and listed in the log: the output head (its logits feed the loss directly;
torchtitan keeps it in bf16 too), any Linear whose dimensions are not multiples of 16 (fp8
tensor-core GEMMs require it), and with ``fp8_filter=auto`` the Linears torchao's measured
H100 thresholds say fp8 makes slower (small K and N).

Under FSDP2 with tensorwise scaling the weights are all-gathered in fp8 (half the traffic
of bf16); their scales are then computed for all layers in one all-reduce after each
optimizer step (:func:`after_optimizer_step`). Under TP, tensorwise scaling uses torchao's
Float8 parallel styles (fp8 all-gathers of activations); rowwise uses the plain styles.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch.nn as nn

from pretrain.errors import UserError

log = logging.getLogger("pretrain")

# Never converted: the output head (fqn suffix).
KEEP_HIGH_PRECISION = ("lm_head",)


class Fp8Error(UserError, ValueError):
    pass


def require_torchao() -> None:
    # On import torchao warns about each of its optional CUDA kernel libraries (mxfp8,
    # cutlass) and Triton it cannot load; float8 training uses neither, so keep the run log
    # clean: only its errors are shown while importing.
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise Fp8Error("precision=fp8 needs torchao: pip install torchao (or "
                       "pip install -e '.[fp8]')") from e
    finally:
        quiet.setLevel(level)


def fp8_filter(recipe: str, which: str):
    """``module_filter_fn(module, fqn) -> bool`` for ``convert_to_float8_training``."""
    if which == "auto":
        from torchao.float8 import _auto_filter_for_recipe

        return _auto_filter_for_recipe(recipe, filter_fqns=list(KEEP_HIGH_PRECISION))

    def divisible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and not fqn.endswith(KEEP_HIGH_PRECISION)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    return divisible


def is_fp8(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def summarize(names: list[str]) -> str:
    """``layers.0.attn.wq, layers.1.attn.wq`` -> ``layers.*.attn.wq (x2)``, in order."""
    counts: dict[str, int] = {}
    for name in names:
        key = re.sub(r"^layers\.\d+\.", "layers.*.", name)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(k if n == 1 else f"{k} (x{n})" for k, n in counts.items()) or "none"


def convert_to_fp8(model: nn.Module, recipe: str, which: str = "auto",
                   fsdp_all_gather: bool = False, emulate: bool = False
                   ) -> tuple[list[str], list[str]]:
    """Convert ``model`` in place; return the (converted, kept in high precision) Linear
    names. ``fsdp_all_gather``: FSDP2 all-gathers the weights in fp8 (tensorwise only)."""
    require_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import Float8LinearRecipeName

    # torchao's own enum: it takes a name only as an exact str (not precision.fp8_recipe's
    # Choice member); our values are its values (tests/test_choices.py).
    config = Float8LinearConfig.from_recipe_name(Float8LinearRecipeName(recipe))
    config = dataclasses.replace(
        config, emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise")
    keep = fp8_filter(recipe, which)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    converted = [n for n in linears if is_fp8(model.get_submodule(n))]
    skipped = [n for n in linears if n not in converted]
    log.info("fp8 (%s scaling%s, filter %s): %d of %d Linear layers converted: %s; kept in "
             "bf16: %s", recipe, ", emulated" if emulate else "", which, len(converted),
             len(linears), summarize(converted), summarize(skipped))
    if not converted:
        log.warning("fp8: no Linear layer was converted (all too small for filter=%s): this "
                    "run is bf16. precision.fp8_filter=all converts every Linear whose "
                    "dimensions are multiples of 16.", which)
    return converted, skipped


def fp8_all_gather(model: nn.Module) -> bool:
    """Whether ``model`` has Float8Linears whose FSDP all-gather runs in fp8."""
    return any(is_fp8(m) and m.config.enable_fsdp_float8_all_gather for m in model.modules())


def after_optimizer_step(parts: list[nn.Module]) -> None:
    """Refresh the fp8 weight scales of FSDP fp8 all-gathers (one all-reduce in all)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
