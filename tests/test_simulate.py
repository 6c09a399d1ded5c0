"""tools/plan.py --simulate: any rank of a 1024-GPU run started on this CPU (fake process
group), its shards initialised for real and measured against the planner."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fork_server import ForkServer

from pretrain.tools import plan as plan_tool

# GPT-3 175B's layout (tp 8 + SP, 16 interleaved pipeline stages x 2, ZeRO-3 over 8: 1024
# GPUs), on a narrow model so the test takes seconds; the real recipe: docs/parallel.md.
NARROW_175B = ["+recipe=gpt3-175b", "model.d_model=256", "model.n_head=8", "model.n_layer=32",
               "model.seq_len=256", "train.global_batch_size=128"]
KEYS = {"world_size", "rank", "layout", "local_param_bytes", "local_grad_bytes",
        "local_optimizer_bytes", "predicted", "init_seconds", "peak_rss_bytes"}


# Each call is ``python tools/plan.py ARGV`` in a fresh process, forked from one that has
# imported the tool once (tests/fork_server.py): a call starts from the state a new process
# has, without importing torch again (9 calls, about 30 s of CPU less).
PLAN = ForkServer("pretrain.tools.plan")


@pytest.fixture(scope="module", autouse=True)
def _stop_the_server():
    yield
    PLAN.close()


def simulate(*argv: str) -> tuple[int, str, str]:
    return PLAN.run(list(argv), timeout=300)


@pytest.mark.parametrize("rank", [0, 1023])  # first + middle stages; middle + last
def test_any_rank_of_a_1024_gpu_run_starts_and_matches_the_planner(rank):
    code, out, err = simulate(*NARROW_175B, "--simulate", "--rank", str(rank))
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])  # the last line is the JSON object
    assert KEYS <= result.keys()
    assert result["world_size"] == 1024 and result["rank"] == rank
    coord = result["coordinate"]  # Megatron order: tp fastest, then dp, then pp
    assert coord["tp"] == rank % 8 and coord["dp_shard"] == rank // 8 % 8
    assert coord["pp"] == rank // 64
    assert result["stages"] == [coord["pp"], coord["pp"] + 16]  # interleaved, 2 per rank
    pred = result["predicted"]
    assert result["local_param_bytes"] == pred["local_param_bytes"] > 0
    assert result["local_optimizer_bytes"] == pred["local_optimizer_bytes"]
    # the planner adds DTensor's replicated gradient of the sharded position table on stage 0
    assert result["local_grad_bytes"] <= pred["local_grad_bytes"]
    assert result["step_peak_bytes"] > result["local_param_bytes"]
    assert f"rank {rank} " in out


def test_a_rank_outside_the_world_is_refused_before_any_work(capsys):
    """In process: the rank is checked before any process group exists."""
    code = plan_tool.main([*NARROW_175B, "--simulate", "--rank", "1024"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "--rank=1024 is not a rank of this 1024-GPU run: use 0..1023" in err
    assert out == ""


def test_fp8_ranks_simulate_with_their_float8_shards():
    """An fp8 recipe (torchao Float8Linear weights, all-gathered in fp8 by FSDP2) is
    simulated with emulated fp8: the same modules and shards as on an H100."""
    code, out, err = simulate("+recipe=gpt3-1.3b", "model.n_layer=2", "precision=fp8",
                              "parallel=zero3", "parallel.dp=8", "--simulate", "--rank", "5",
                              "--no-step")
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["precision"] == "fp8" and result["coordinate"]["dp_shard"] == 5
    assert result["local_param_bytes"] == result["predicted"]["local_param_bytes"] > 0
    assert "step_peak_bytes" not in result  # --no-step


@pytest.mark.parametrize(("hsdp", "rank", "coordinate"), [
    ([], 5, {"ep": 1, "dp_shard_mod_ep": 1}),
    (["parallel.dp_replicate=2", "parallel.dp_shard=8"], 13,
     {"dp_replicate": 1, "dp_shard_mod_ep": 1, "ep": 1}),
])
def test_an_expert_parallel_rank_holds_what_the_planner_counts(hsdp, rank, coordinate):
    """A rank of 16 with the experts split over 4 ranks and each rank's experts sharded by
    FSDP over the rest of its shard group (dim 1), alone or in one of 2 HSDP replicas: its
    parameter and optimizer bytes, and the fake step with its all-to-all, against the
    planner's."""
    code, out, err = simulate("+recipe=moe-tiny", "precision=bf16", "parallel=zero3",
                              "parallel.dp=16", *hsdp, "train.global_batch_size=16",
                              "parallel.micro_batch_size=1", "parallel.ep=4", "model.n_layer=2",
                              "--gpu", "h100-80gb", "--simulate", "--rank", str(rank))
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert coordinate.items() <= result["coordinate"].items()
    pred = result["predicted"]
    assert result["local_param_bytes"] == pred["local_param_bytes"] > 0
    assert result["local_optimizer_bytes"] == pred["local_optimizer_bytes"]
    assert result["step_peak_bytes"] > result["local_param_bytes"]


@pytest.mark.parametrize("optim", ["muon", "lars"])
def test_other_optimizers_hold_what_the_planner_counts(optim):
    """optim=muon (a momentum for each block matrix, AdamW's two moments and step for the
    rest) and optim=lars (one momentum) on a rank of the narrow 175B layout (TP 8, ZeRO-3,
    interleaved stages): the optimizer bytes equal the planner's; the planner adds Muon's
    gathered matrix and Newton-Schulz working set as the step's transient."""
    lr = ["optim.lr=2"] if optim == "lars" else []  # GPT-3's 6e-5 is refused for LARS
    code, out, err = simulate(*NARROW_175B, f"optim={optim}", *lr, "--simulate", "--rank", "9",
                              "--no-step")
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    pred = result["predicted"]
    assert result["local_optimizer_bytes"] == pred["local_optimizer_bytes"] > 0
    transient = pred["memory_by_part"]["optimizer step transient"]
    if optim == "muon":  # the 1024 x 256 MLP matrix in fp32, and bf16 copies and Grams,
        # after the Nesterov update of this rank's shard (tp 8 x dp 8: 1/64 of it) in fp32
        assert transient == (4 * 1024 * 256 // 64 + 4 * 1024 * 256
                             + 2 * (2 * 1024 * 256 + 2 * 256 * 256))
        adamw = result["local_param_bytes"] * 2  # what AdamW would hold, less its steps
        assert result["local_optimizer_bytes"] < adamw
    else:
        assert transient == 0
        assert result["local_optimizer_bytes"] == result["local_param_bytes"]


@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_the_optimizer_step_holds_what_the_planner_counts(optim):
    """The fake step runs the optimizer step too, measured apart from forward and backward:
    on a zero3 dp=4 rank its excess over what the step starts with (Muon: a shard-sized
    Nesterov update, the whole gathered matrix, Newton-Schulz's bf16 working set) is the
    planner's optimizer step transient; fused AdamW (the GPU's) holds none."""
    code, out, err = simulate("+recipe=llama-tiny", "model.n_layer=2", "model.seq_len=64",
                              "precision=fp32", "parallel=zero3", "parallel.dp=4",
                              "parallel.micro_batch_size=1", "train.global_batch_size=4",
                              f"optim={optim}", "--simulate", "--rank", "1")
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    pred, ratio = result["predicted"], result["measured_over_planner"]
    measured = result["optimizer_step_transient_bytes"]
    if optim == "muon":  # the 704 x 256 SwiGLU matrix
        assert pred["optimizer_step_transient_bytes"] == (
            4 * 176 * 256 + 4 * 704 * 256 + 2 * (2 * 704 * 256 + 2 * 256 * 256))
        assert ratio["optimizer_step_transient_bytes"] == pytest.approx(1.0, abs=0.1)
    else:
        assert pred["optimizer_step_transient_bytes"] == 0
        assert measured <= 0.01 * result["optimizer_step_start_bytes"]
    assert ratio["optimizer_step_peak_bytes"] == pytest.approx(1.0, abs=0.1)
    assert "optimizer step transient   measured" in out


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_the_simulated_optimizer_is_the_one_a_gpu_run_builds(optim):
    """The fake step's optimizer runs the kernels a CUDA run's does (fused AdamW: no
    per-tensor temporaries; a foreach or for-loop AdamW would hold some), whatever this
    CPU would pick for itself: its (class, fused, foreach) equal build_optimizer's for a
    CUDA device."""
    import torch

    from pretrain.config.compose import compose_config
    from pretrain.model.gpt import GPT
    from pretrain.optim.specs import build_optimizer
    from pretrain.parallel.layout import resolve_layout
    from pretrain.planning.simulate import (
        TARGET,
        _build_optimizer,
        implementation,
        optimizer_device,
    )

    cfg = compose_config(["+recipe=llama-tiny", "model.n_layer=2", f"optim={optim}"])
    model = GPT(cfg.model)
    pm = SimpleNamespace(parts=[model], tied=None)  # what _build_optimizer reads
    simulated = implementation(_build_optimizer(pm, cfg, 1e-3, TARGET))
    gpu = implementation(build_optimizer(torch.nn.ModuleList([model]), cfg.optim, 1e-3,
                                         torch.device("cuda")))
    cpu = implementation(build_optimizer(model, cfg.optim, 1e-3, torch.device("cpu")))
    assert simulated == gpu
    assert ("AdamW", True, False) in simulated and simulated != cpu
    offload = resolve_layout(compose_config(["+recipe=llama-tiny", "parallel.offload=params"]),
                             1)
    assert optimizer_device(offload).type == "cpu"  # the host steps: the trainer's for-loop
    assert implementation(_build_optimizer(pm, cfg, 1e-3, optimizer_device(offload))) == cpu
