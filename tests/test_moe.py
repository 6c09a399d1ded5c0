"""Mixture of experts: routing against a per-token reference, grouped GEMMs against the
loop, the auxiliary losses' gradients, DeepSeek-V3's bias update, the presets' published
counts against transformers, the accounting (active parameters), the layout rules, and a
training run that logs the expert load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from pretrain.budget.compute import count_params, resolve_budget
from pretrain.config.schema import ConfigError, ModelConfig
from pretrain.model.moe import MoE, aux_loss_scale, grouped_linear, routing_stats, update_biases

TINY = ModelConfig(name="t", n_layer=2, n_head=2, d_model=32, vocab_size=64, seq_len=16,
                   mlp="swiglu", bias=False, moe_experts=4, moe_top_k=2, moe_d_ff=24)


def build(cfg: ModelConfig, shared: bool = False) -> MoE:
    from pretrain.model.gpt import MLP

    torch.manual_seed(0)
    moe = MoE(cfg, cfg.moe_d_ff, MLP(cfg, cfg.moe_d_ff) if shared else None)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    moe.reset_state()
    return moe


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the experts, the top k, each expert's SwiGLU."""
    out = torch.zeros_like(x)
    e = moe.experts
    for t in range(x.shape[0]):
        probs = (moe.router.weight @ x[t]).softmax(-1)
        top = probs.topk(moe.top_k).indices
        w = probs[top] / (probs[top].sum() if moe.norm_topk else 1)
        for k, i in enumerate(top):
            h = F.silu(e.w1[i] @ x[t]) * (e.w3[i] @ x[t])
            out[t] += w[k] * (e.w2[i] @ h)
    if moe.shared is not None:
        out += moe.shared(x)
    return out


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_routing_and_experts_match_a_token_by_token_reference(norm_topk, shared):
    moe = build(dataclasses.replace(TINY, moe_norm_topk=norm_topk), shared)
    x = torch.randn(2, 16, 32)
    got = moe.eval()(x)
    want = reference(moe, x.reshape(-1, 32)).reshape(x.shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert moe.tokens_per_expert.sum() == 0  # evaluation is not counted
    with torch.no_grad():
        torch.testing.assert_close(moe.train()(x), got)  # no aux in the output's values
    assert moe.tokens_per_expert.sum() == 2 * 16 * 2  # every token counted top_k times


def test_grouped_gemm_equals_the_loop_with_empty_groups_and_gradients():
    x = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(4, 8, 16, requires_grad=True)
    counts = torch.tensor([5, 0, 7, 0])
    got = grouped_linear(x, w, counts)  # torch._grouped_mm on this CPU (fp32, aligned)
    g = torch.randn_like(got)
    got.backward(g)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = torch.cat([x[:5] @ w[0].t(), x[5:] @ w[2].t()])
    want.backward(g)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    odd = grouped_linear(x[:, :15], w[:, :, :15], counts)  # unaligned rows: the loop
    torch.testing.assert_close(odd, torch.cat([x[:5, :15] @ w[0, :, :15].t(),
                                               x[5:, :15] @ w[2, :, :15].t()]))


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_and_z_losses_reach_the_router_as_if_added_to_the_loss(scale):
    """AuxLoss carries the balancing and z losses into backward with the micro batch's
    weight: the router's gradient equals that of loss + aux, computed by hand."""
    cfg = dataclasses.replace(TINY, moe_aux_coeff=0.1, moe_z_coeff=0.01)
    moe = build(cfg).train()
    x = torch.randn(32, 32)
    with aux_loss_scale(scale):
        (moe(x).square().sum() * scale).backward()
    got = moe.router.weight.grad.clone()
    moe.zero_grad()
    logits, experts, _ = moe.route(x)
    counts = torch.bincount(experts.reshape(-1), minlength=4)
    f = counts.float() / experts.numel()
    aux = 0.1 * 4 * (f * logits.softmax(-1).mean(0)).sum() \
        + 0.01 * torch.logsumexp(logits, -1).square().mean()
    moe.balance, moe.aux_coeff, moe.z_coeff = "none", 0.0, 0.0  # the output alone
    ((moe(x).square().sum() + aux) * scale).backward()
    torch.testing.assert_close(got, moe.router.weight.grad, rtol=1e-4, atol=1e-4)


def test_aux_free_bias_moves_against_the_load_and_balances_it():
    cfg = dataclasses.replace(TINY, moe_balance="aux_free", moe_bias_rate=0.01)
    moe = build(cfg).train()
    with torch.no_grad():  # a router that prefers expert 0
        moe.router.weight[0] = 0.05 * torch.ones(32)
    gen = torch.Generator().manual_seed(0)
    loads = []
    for _ in range(100):
        moe(torch.randn(256, 32, generator=gen).abs())
        loads.append(moe.step_tokens.max().item() / moe.step_tokens.mean().item())
        update_biases(moe, lambda t: t)
    assert moe.expert_bias[0] == moe.expert_bias.min() < 0
    assert loads[0] > 1.8 and sum(loads[-20:]) / 20 < 1.3, (loads[0], loads[-20:])


def test_routing_stats_report_the_busiest_expert_over_the_mean():
    moe = build(TINY).train()
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 2.0, 2.0]))
    moe.last_aux = torch.tensor(0.5)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"3": torch.nn.Module()})})
    model.layers["3"].moe = moe
    stats = routing_stats(model, lambda t: t)
    assert stats == {"moe/max_load_3": 2.5, "moe/aux_loss_3": 0.5}
    assert moe.tokens_per_expert.sum() == 0  # counted afresh for the next window


@pytest.mark.parametrize(("preset", "total", "active"), [
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),  # 46.7B / 12.9B (Jiang et al. 2024)
    ("olmoe-1b-7b", 6_919_161_856, 1_282_017_280),  # 6.9B / 1.3B (Muennighoff et al. 2024)
])
def test_presets_have_the_published_counts_and_transformers_agrees(compose, preset, total,
                                                                   active):
    import transformers

    m = compose([f"model={preset}"]).model
    counts = count_params(m)
    assert (counts.total, counts.active) == (total, active)
    if preset.startswith("mixtral"):
        hf = transformers.MixtralConfig(
            vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
            num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
            num_key_value_heads=m.n_kv_head, num_local_experts=m.moe_experts,
            num_experts_per_tok=m.moe_top_k, tie_word_embeddings=False)
        cls = transformers.MixtralForCausalLM
    else:
        hf = transformers.OlmoeConfig(
            vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.moe_d_ff,
            num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
            num_key_value_heads=m.n_head, num_experts=m.moe_experts,
            num_experts_per_tok=m.moe_top_k, tie_word_embeddings=False)
        cls = transformers.OlmoeForCausalLM
    with torch.device("meta"):
        assert sum(p.numel() for p in cls(hf).parameters()) == total


def test_moe_tiny_has_the_dense_models_active_parameters_and_compute(compose):
    """moe-tiny is llama-tiny with 8 experts of a quarter width, 2 per token: the same
    active parameters but for the router (4 x 256 x 8), 6 N_active D as its compute."""
    moe, dense = (compose([f"model={n}"]) for n in ("moe-tiny", "llama-tiny"))
    cm, cd = count_params(moe.model), count_params(dense.model)
    assert cm.active - cd.active == 4 * 256 * 8 and cm.total > 2 * cd.total
    b = resolve_budget(moe.model, moe.budget, moe.train.global_batch_size)
    assert b.n_params_active == cm.active and b.compute == 6 * cm.active * b.tokens


@pytest.mark.parametrize(("overrides", "says"), [
    (["model.moe_top_k=9"], "moe_top_k=9 must be between 1 and model.moe_experts=8"),
    (["parallel.tp=2", "parallel.dp=1"], "does not shard a mixture of experts"),
    (["model.moe_first_dense=4"], "must leave at least one"),
    (["train.compile=true", "precision=fp32"], "compile in bf16 only"),
    # expert parallelism: what it composes with, refused before any work
    (["parallel.dp=2", "parallel.ep=3"], "moe_experts=8 is not divisible by parallel.ep=3"),
    (["parallel.dp=2", "parallel.ep=2", "parallel.dp_mode=ddp"], "runs with FSDP"),
    (["parallel.dp=4", "parallel.ep=2", "parallel.dp_replicate=4", "parallel.dp_shard=1"],
     "must divide the data-parallel shard group"),
    (["parallel.dp=2", "parallel.ep=4"], "must divide the data-parallel shard group"),
    (["parallel.dp=2", "parallel.ep=2", "parallel.activation_checkpointing=selective"],
     "op-level selective checkpointing is not supported"),
    (["model=llama-tiny", "parallel.dp=2", "parallel.ep=2"], "the model has none"),
])
def test_bad_moe_settings_are_refused_naming_the_key(compose, overrides, says):
    from pretrain.decision.checks import check

    with pytest.raises(ConfigError, match=says):
        check(compose(["model=moe-tiny", *overrides]))


def test_fsdp_shards_experts_along_their_rows_when_the_ranks_outnumber_them():
    from pretrain.parallel.data_parallel import shard_dim
    from pretrain.planning.params import fsdp_numel

    assert shard_dim((8, 14336, 4096), 8) == 0 and shard_dim((8, 14336, 4096), 64) == 1
    assert fsdp_numel((8, 14336, 4096), 64) == 8 * 224 * 4096  # not one padded expert each


@pytest.mark.slow
def test_an_moe_block_compiles_whole_in_bf16():
    """fullgraph=True, as every GPU recipe compiles a block: no graph break in routing,
    counting or the grouped GEMMs, and the numbers of eager mode."""
    from pretrain.model.gpt import Block

    block = Block(TINY, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    block.moe.reset_state()
    block = block.bfloat16().train()
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    eager = block(x, None)
    compiled = torch.compile(block, fullgraph=True)(x, None)
    torch.testing.assert_close(compiled, eager, atol=0.05, rtol=0.05)


def test_a_moe_tiny_run_trains_and_reports_the_expert_load(compose, prepared, tmp_path):
    from helpers import read_metrics

    from pretrain.train.trainer import run

    cfg = compose(["model=moe-tiny", "model.vocab_size=300", "model.seq_len=32",
                   "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.n_kv_head=1",
                   "model.moe_d_ff=32", "precision=fp32", "data.name=tinytext",
                   f"data.root={prepared.parent}", "data.auto_prepare=false",
                   "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
                   "parallel.micro_batch_size=4", "budget=steps", "budget.steps=6",
                   "logging=quiet", "logging.wandb=disabled", "logging.log_interval=2",
                   "train.eval_batches=1", "train.sample_tokens=0", "schedule.warmup_steps=1"])
    result = run(cfg, tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert rows and all(r["moe/max_load_0"] >= 1 and r["moe/aux_loss_1"] > 0 for r in rows)
    assert result["expert_max_load"] >= 1
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["n_params_active"] < plan["n_params"]
