"""Model presets have the published parameter counts (GPT-2 exactly, GPT-3 within 2%)."""

from __future__ import annotations

import pytest
import torch
from helpers import CONF_DIR
from omegaconf import OmegaConf

from pretrain.budget.compute import count_params
from pretrain.config.schema import ModelConfig


def load_model_config(name: str) -> ModelConfig:
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                           OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(node)


GPT2 = {  # preset: (published count of the released checkpoint, n_layer, n_head, d_model)
    "gpt2-124m": (124_439_808, 12, 12, 768),
    "gpt2-355m": (354_823_168, 24, 16, 1024),
    "gpt2-774m": (774_030_080, 36, 20, 1280),
    "gpt2-1.5b": (1_557_611_200, 48, 25, 1600),
}


@pytest.mark.parametrize("preset", list(GPT2))
def test_gpt2_presets_match_published_and_transformers(preset):
    from transformers import GPT2Config, GPT2LMHeadModel

    published, n_layer, n_head, d_model = GPT2[preset]
    cfg = load_model_config(preset)
    assert (cfg.n_layer, cfg.n_head, cfg.d_model) == (n_layer, n_head, d_model)
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=d_model,
                                        n_positions=1024, vocab_size=50257))
    hf_count = sum(p.numel() for p in hf.parameters())
    counts = count_params(cfg)
    assert hf_count == published
    assert counts.total == published
    # Non-embedding: minus the token (50257 x d) and position (1024 x d) tables.
    assert counts.non_embedding == published - 50257 * d_model - 1024 * d_model


# Llama 3.1 (Dubey et al. 2024, Table 3), counted by transformers' LlamaForCausalLM.
LLAMA3 = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
          "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("preset", list(LLAMA3))
def test_llama3_presets_match_transformers(preset):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = load_model_config(preset)
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(
            hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_kv_head, vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.seq_len, tie_word_embeddings=False))
    assert sum(p.numel() for p in hf.parameters()) == LLAMA3[preset]
    assert count_params(cfg).total == LLAMA3[preset]


# Brown et al. 2020, Table 2.1, "n_params".
GPT3 = {
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9,
}


@pytest.mark.parametrize("preset", list(GPT3))
def test_gpt3_presets_within_two_percent_of_table_2_1(preset):
    cfg = load_model_config(preset)
    assert cfg.seq_len == 2048
    total = count_params(cfg).total
    assert abs(total - GPT3[preset]) / GPT3[preset] < 0.02, f"{preset}: {total:,}"


def test_gpt3_175b_count_by_hand():
    # 96 blocks of 12 d^2 + 13 d (four d x d attention matrices and two d x 4d MLP matrices,
    # with biases, two LayerNorms), a final LayerNorm, token and position tables.
    d, n_layer = 12288, 96
    expected = n_layer * (12 * d * d + 13 * d) + 2 * d + 50257 * d + 2048 * d
    counts = count_params(load_model_config("gpt3-175b"))
    assert counts.total == expected
    assert counts.non_embedding == expected - 50257 * d - 2048 * d


def test_untied_padded_vocab_counts():
    # Untied: the output head is its own 320 x 64 matrix (300 rounded up to a multiple of 64).
    cfg = load_model_config("nano")
    cfg.vocab_size, cfg.pad_vocab_to, cfg.tie_embeddings = 300, 64, False
    tied = load_model_config("nano")
    tied.vocab_size, tied.pad_vocab_to = 300, 64
    untied_counts, tied_counts = count_params(cfg), count_params(tied)
    # n_params leaves the 20 padded rows out (said apart as padding); the head's 300 real
    # rows count, and its padded rows are padding too
    assert untied_counts.total - tied_counts.total == 300 * 64
    assert (tied_counts.padding, untied_counts.padding) == (20 * 64, 2 * 20 * 64)
    # non-embedding excludes the token (300 x 64) and position (64 x 64) tables only.
    assert untied_counts.non_embedding == untied_counts.total - 300 * 64 - 64 * 64
    # the head's GEMM computes its padded rows: hardware FLOPs count them
    assert untied_counts.matmul == untied_counts.non_embedding + 20 * 64


def test_gpt2_124m_padded_to_128_still_reads_the_published_count():
    cfg = load_model_config("gpt2-124m")
    assert cfg.pad_vocab_to == 128
    counts = count_params(cfg)
    assert counts.total == 124_439_808
    assert counts.padding == (50304 - 50257) * 768


# -- the planner's per-rank parameters come from the rules the real code applies -----------

GPT2_STYLE = dict(name="gpt2-style", n_layer=4, n_head=4, d_model=64, seq_len=32,
                  vocab_size=300, pad_vocab_to=64)
LLAMA_STYLE = dict(name="llama-style", n_layer=4, n_head=4, n_kv_head=2, d_model=64,
                   seq_len=32, vocab_size=300, pad_vocab_to=64, pos_emb="rope",
                   norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)


def _tp_probe(model: dict, tp: int, rank: int) -> dict:
    """Run in a child process: the GPT of ``model`` on the meta device, parallelised by
    ``apply_tensor_parallel`` (the real TP plan) over a fake process group of ``tp`` ranks;
    for every parameter, the dimension its DTensor is sharded on and this rank's shape."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.model.gpt import GPT
    from pretrain.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        gpt = GPT(ModelConfig(**model))
    apply_tensor_parallel(gpt, mesh, sequence_parallel=True)
    out = {}
    for name, p in gpt.named_parameters():
        (placement,) = p.placements
        out[name] = [placement.dim if isinstance(placement, Shard) else None,
                     list(p.to_local().shape)]
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("model", [GPT2_STYLE, LLAMA_STYLE], ids=lambda m: m["name"])
def test_planner_tp_shards_equal_the_real_tp_plan(model):
    """Every parameter: the dimension the planner shards (``tp_shard_dim``) and the local
    shape it counts equal those of the model parallelised with the real plan, rank 1 of 2."""
    import json
    import subprocess
    import sys

    from pretrain.planning.params import inventory, tp_local_shape

    code = (f"import json, test_params; print(json.dumps(test_params._tp_probe("
            f"{model!r}, 2, 1)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=str(CONF_DIR.parent / "tests"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    params = inventory(ModelConfig(**model))
    assert sorted(real) == sorted(p.name for p in params)
    sharded = set()
    for p in params:
        dim, shape = real[p.name]
        assert (p.tp_dim, list(tp_local_shape(p, 2, 1))) == (dim, shape), p.name
        sharded |= {p.name} if dim is not None else set()
    assert {"layers.0.attn.wq.weight", "layers.0.attn.wo.weight", "tok_emb.weight"} <= sharded


LAYOUTS = {  # parallel config of a 2-rank pipeline, 8 layers
    "1f1b": dict(pp=2), "gpipe": dict(pp=2, pp_schedule="gpipe"),
    "interleaved x2": dict(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
    "zbv": dict(pp=2, pp_schedule="zbv", virtual_stages=2),
}


@pytest.mark.parametrize("model", [GPT2_STYLE, LLAMA_STYLE], ids=lambda m: m["name"])
@pytest.mark.parametrize("par", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_planner_stage_split_equals_the_pipeline_split(model, par):
    """For every pipeline rank, the planner's blocks and parameter elements equal what
    ``parallel.pipeline.split_model`` keeps on that rank (tied head copies included)."""
    from pretrain.config.schema import Config, ParallelConfig
    from pretrain.model.gpt import GPT
    from pretrain.parallel.layout import resolve_layout
    from pretrain.parallel.pipeline import split_model
    from pretrain.planning.params import rank_params

    cfg = Config()
    cfg.model = ModelConfig(**{**model, "n_layer": 8})
    cfg.parallel = ParallelConfig(**par, micro_batch_size=1)
    cfg.train.global_batch_size = 8
    layout = resolve_layout(cfg, 2)
    with torch.device("meta"):
        gpt = GPT(cfg.model)
    for pp_rank in range(2):
        _, parts = split_model(gpt, layout, pp_rank)
        planned = rank_params(cfg.model, layout, pp_rank)
        assert len(planned.blocks) == sum(len(part.layers) for part in parts)
        assert planned.unsharded == sum(p.numel() for part in parts for p in part.parameters())


@pytest.mark.parametrize("overrides", [["model=gpt3-1.3b"], ["+recipe=mixtral-8x7b"],
                                       ["+recipe=moe-tiny"]])
def test_linear_elements_are_the_inventorys_sums(overrides):
    """The cost model's FLOPs read ``params.linear_elements`` (once per model): the block
    Linears' elements, the routed experts' and each Linear's by name, as summed over the
    inventory itself."""
    import math

    from helpers import compose_config

    from pretrain.planning.params import inventory, linear_elements

    m = compose_config(overrides).model
    got, inv = linear_elements(m), inventory(m)
    block = [q for q in inv if q.layer is not None and q.matmul]
    assert got["matmul"] == sum(math.prod(q.shape) for q in block)
    assert got["experts"] == sum(math.prod(q.shape) for q in inv if ".experts." in q.name)
    for name in {q.name.split(".")[-2] for q in block}:
        assert got[name] == sum(math.prod(q.shape) for q in block
                                if q.name.split(".")[-2] == name)
    assert (got["experts"] > 0) == bool(m.moe_experts)
