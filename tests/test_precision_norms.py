"""Norms under mixed precision: no autocast, so a bf16 residual stream goes into torch's own
RMSNorm/LayerNorm, which must compute in fp32 inside and hand back bf16 (docs/precision.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.config.schema import ModelConfig
from pretrain.model.gpt import make_norm


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_norms_compute_in_fp32_and_return_bf16(norm):
    g = torch.Generator().manual_seed(0)
    module = make_norm(ModelConfig(d_model=256, norm=norm))
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(256, generator=g))
        if getattr(module, "bias", None) is not None:
            module.bias.copy_(0.1 * torch.randn(256, generator=g))
    module.to(torch.bfloat16)  # as FSDP2's mixed precision gathers the weights
    x = (3 * torch.randn(4, 64, 256, generator=g) + 1).bfloat16()
    out = module(x)
    assert out.dtype == torch.bfloat16
    w = module.weight.float()
    if norm == "rmsnorm":
        ref = F.rms_norm(x.float(), (256,), w, module.eps)
    else:
        ref = F.layer_norm(x.float(), (256,), w, module.bias.float(), module.eps)
    # within one bf16 rounding of the fp32 result: statistics taken in fp32, not bf16
    ulp = ref.abs().clamp_min(2**-126) * 2**-7
    assert ((out.float() - ref).abs() <= ulp).all()
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight \
        if norm == "rmsnorm" else None
    if naive is not None:  # a bf16-throughout RMSNorm is measurably worse
        assert (naive.float() - ref).abs().max() > (out.float() - ref).abs().max()
