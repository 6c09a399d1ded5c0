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

from pretrain.config.schema import ModelConfig
from pretrain.model.gpt import GPT, set_attention_backend
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


@pytest.mark.slow
def test_each_block_compiles_fullgraph_under_every_mode():
    """CPU inductor; ``fullgraph=True`` makes any graph break an error. One test compiles
    the two checkpointing modes (the same block code, so inductor's caches are shared
    between them). The other two are blocks these compile already: ``selective`` every 2nd
    layer is a ``selective`` block beside a plain one (its gradients: the eager test above),
    and plain blocks compile without a break inside the whole model's one graph in
    tests/test_precision.py's test_one_process_compiles_model_and_loss_as_one_graph (all
    four were compiled here before issue 69: 177 s on a busy 2-core machine)."""
    ref = grads(build(LLAMA, "none", 0), LLAMA)
    with one_thread():
        for mode, every_n in [("full", 0), ("selective", 0)]:
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


@pytest.mark.slow
def test_sequence_parallel_none_keeps_shards_the_planner_counts():
    """Under TP 2 with SP, ``none`` keeps the gathered Linear inputs as shards: what the
    blocks of a rank hold after forward equals the planner's ``layer_bytes`` (the
    column-parallel outputs, attention output and log-sum-exp, reduce-scatter outputs,
    block input), and is less than half of what DTensor's own saving holds (measured here
    111,616 against 255,488 bytes)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from pretrain.planning.activations import layer_bytes

    model = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=32, vocab_size=128,
                 pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    specs = [{"tp": 2, "micro_batch": 2, "model": model, "sp_policy": p} for p in (True, False)]
    code = ("import json, sys; sys.path.insert(0, 'tests'); import memory_probe as m; "
            "[print(m.forked(s, m.sp_blocks_saved), flush=True) for s in json.loads(sys.argv[1])]")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(specs)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[1])
    sharded, gathered = (json.loads(line) for line in proc.stdout.splitlines())
    assert "error" not in sharded and "error" not in gathered, proc.stdout + proc.stderr[-2000:]
    cfg = ModelConfig(**model)
    a = ActivationSetup(micro_batch=2, tp=2, sequence_parallel=True, sp_saves_gathered=False,
                        autocast=False)
    planned = cfg.n_layer * layer_bytes(cfg, a, "none")
    assert sharded["saved"] == pytest.approx(planned, rel=0.1), (sharded, planned)
    assert sharded["saved"] < 0.5 * gathered["saved"], (sharded, gathered)
