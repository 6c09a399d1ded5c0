"""Activation checkpointing as parallel/activation_checkpoint.py applies it: every mode gives
the gradients of no checkpointing, each block compiles as one graph (``fullgraph=True``) with
its checkpoint region inside, and the op-level selective policy keeps what the planner counts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import one_thread
from torch.utils.checkpoint import CheckpointPolicy

from pretrain.config import ModelConfig
from pretrain.model import GPT, set_attention_backend
from pretrain.parallel import activation_checkpoint as ac
from pretrain.planning.activations import ActivationSetup, op_selective_terms

LLAMA = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=32, vocab_size=128,
                    pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)
GPT2 = ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=128)
MODES = [("none", 0), ("full", 0), ("selective", 0), ("selective", 2)]


def build(cfg: ModelConfig, mode: str, every_n: int, compile_blocks: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(0)
    set_attention_backend(model, "sdpa")
    ac.apply_activation_checkpointing(model.layers, mode, every_n)
    if compile_blocks:  # as parallel/apply.py does
        for block in model.layers.values():
            block.compile(fullgraph=True)
    return model


def grads(model: GPT, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    model(x).float().logsumexp(-1).mean().backward()
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("mode,every_n", MODES, ids=[f"{m}{n or ''}" for m, n in MODES])
def test_checkpointing_gives_the_gradients_of_none(cfg, mode, every_n):
    ref = grads(build(cfg, "none", 0), cfg)
    got = grads(build(cfg, mode, every_n), cfg)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)


def test_each_block_compiles_fullgraph_under_every_mode():
    """CPU inductor; ``fullgraph=True`` makes any graph break an error. One test compiles
    all four modes: the same block code, so inductor's caches are shared between them."""
    ref = grads(build(LLAMA, "none", 0), LLAMA)
    with one_thread():
        for mode, every_n in MODES:
            torch._dynamo.reset()
            got = grads(build(LLAMA, mode, every_n, compile_blocks=True), LLAMA)
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5,
                                           msg=f"{mode}: {name}")
    torch._dynamo.reset()


def saved_matmuls(cfg: ModelConfig) -> list[bool]:
    """Per matmul of one block's forward, in order, whether the selective policy keeps it."""
    decisions: list[bool] = []
    policy = ac._policy(ac._save_list())

    class Ctx:
        is_recompute = False

    def spy(func, *args, **kwargs):
        out = func(*args, **kwargs)
        if func in ac.MATMULS:
            decisions.append(policy(Ctx(), func) == CheckpointPolicy.MUST_SAVE)
        return out

    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return spy(func, *args, **(kwargs or {}))

    block = copy.deepcopy(build(cfg, "none", 0).layers["0"])
    with Spy(), torch.no_grad():
        block(torch.randn(2, cfg.seq_len, cfg.d_model), None)
    return decisions


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_policy_recomputes_the_linears_the_planner_names(cfg):
    keeps = saved_matmuls(cfg)
    names = ac.block_linears(cfg)
    assert len(keeps) == len(names)
    recomputed = [n for n, keep in zip(names, keeps, strict=True) if not keep]
    assert recomputed == ac.recomputed_linears(cfg)
    a = ActivationSetup(micro_batch=2, device="cpu", autocast=False)
    kept = " ".join(n for n in names if n not in recomputed)
    assert f"saved matmul outputs ({kept})" in op_selective_terms(cfg, a)
