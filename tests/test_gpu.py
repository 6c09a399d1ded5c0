"""The gpu tier: what only a CUDA GPU can show, in one command on one GPU (``pytest -m gpu``,
a few minutes on an H100; conftest.py skips it without CUDA). The rest of the suite means
the CPU and says so (tests/helpers.compose_config: ``train.device=cpu``); these say
``train.device=cuda``.

Covered: a compiled gpt2-124m step with no graph break; ``precision=auto`` taking bf16; SDPA
running cuDNN or flash attention on Hopper; fp8 Linears (torchao, real fp8 GEMMs) tracking
bf16's loss for 20 steps; an async checkpoint staged from GPU memory loading back bit-exactly;
``parallel.offload=params`` training from pinned host copies; tools/bench_gpu.py running one
cell; ``tools/plan.py --simulate`` of a 1.3B rank on the CUDA build within 10% of the
planner for forward/backward and for the optimizer step; a CUDA memory snapshot at a chosen step
and on an out-of-memory error; CUDA graphs (``train.cuda_graphs``) training as the
compiled step without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import MARKOV_DATA, REPO, compose_config, run_group
from torch.distributed.tensor import DTensor

from pretrain.train.trainer import Trainer

pytestmark = pytest.mark.gpu

GPU = "train.device=cuda"
# markov data (vocabulary 256) for every model here; each test names its model
COMMON = [*MARKOV_DATA, "budget=steps", "train.eval_interval=1000", "train.sample_tokens=0",
          "logging=quiet", GPU]


def hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


def trainer(markov_root, tmp_path, *overrides: str) -> Trainer:
    cfg = compose_config([*COMMON, f"data.root={markov_root}", f"runs_dir={tmp_path}",
                          *overrides])
    t = Trainer(cfg, tmp_path / "run")
    t.setup()
    return t


def test_a_compiled_gpt2_124m_step_has_no_graph_break(markov_root, tmp_path):
    """Each block compiles with fullgraph=True (a break would raise); the counters say no
    graph broke anywhere and that compiled graphs did run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    t = trainer(markov_root, tmp_path, "model=gpt2-124m", "precision=bf16",
                "model.attention=sdpa", "train.compile=true", "budget.steps=3",
                "train.global_batch_size=8", "parallel.micro_batch_size=8",
                "train.noise_scale=false")
    try:
        losses = [t.train_step()[0] for _ in range(3)]
    finally:
        t.close()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1


def test_auto_precision_takes_bf16_on_the_gpu():
    from pretrain.decision.resolve import resolve_plan

    plan = resolve_plan(compose_config([GPU])).plan
    assert plan["device"].startswith("cuda")
    assert plan["precision"] == "bf16", plan.get("precision_auto")
    assert plan["precision_auto"].startswith("bf16: ") and "compute capability" in \
        plan["precision_auto"]


def test_sdpa_runs_cudnn_or_flash_attention_on_hopper():
    """The model's SDPA (cuDNN first on compute capability 9.0+: attention.sdpa_priority),
    forward and backward in bf16 at gpt2-124m's shapes: a fused kernel, never the math or
    memory-efficient fallbacks."""
    if not hopper():
        pytest.skip(f"{torch.cuda.get_device_name()} is not Hopper or newer")
    from torch.profiler import ProfilerActivity, profile

    from pretrain.model.attention import kernel

    device = torch.device("cuda")
    q, k, v = (torch.randn(4, 1024, 12, 64, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    attend = kernel("sdpa", device)
    attend(q, k, v).sum().backward()  # warm: kernels picked and loaded
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attend(q, k, v).sum().backward()
    ops = {e.key for e in prof.key_averages()}
    fused = {"aten::_scaled_dot_product_cudnn_attention",
             "aten::_scaled_dot_product_flash_attention"}
    assert ops & fused, sorted(o for o in ops if "attention" in o)
    assert not ops & {"aten::_scaled_dot_product_efficient_attention",
                      "aten::_scaled_dot_product_attention_math"}


def test_cuda_graphs_train_as_the_compiled_step_with_accumulation(
        markov_root, tmp_path):
    """``train.cuda_graphs=true`` replays forward+loss+backward; two micro batches a step
    run the graph twice before the optimizer step (as the noise scale's two halves do in a
    step of one micro batch). On an H200 (torch 2.11) the default recipe with graphs on
    failed at once ("accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run": a replay's gradient kept as .grad); the gradients now stay allocated.
    Same losses as the compiled step without graphs, from the same weights and batches."""
    losses = {}
    for graphs in ("true", "false"):
        torch._dynamo.reset()
        t = trainer(markov_root, tmp_path / graphs, "model=tiny", "model.vocab_size=256",
                    "precision=bf16", "model.attention=sdpa", "train.compile=true",
                    f"train.cuda_graphs={graphs}", "budget.steps=8",
                    "train.global_batch_size=16", "parallel.micro_batch_size=8",
                    "train.noise_scale=true")
        try:
            losses[graphs] = [float(t.train_step()[0]) for _ in range(8)]
        finally:
            t.close()
    for step, (a, b) in enumerate(zip(losses["true"], losses["false"], strict=True), 1):
        assert abs(a - b) <= 0.02, (step, losses)
    assert losses["true"][-1] < losses["true"][0], losses


def test_fp8_linears_run_and_track_bf16_for_20_steps(markov_root, tmp_path):
    """torchao Float8Linear (real fp8 GEMMs, no emulation) against bf16 from the same
    initial weights and batches. The CPU's emulated run (tests/test_fp8.py) stays within
    1.7e-3 over 30 steps; 0.05 here still catches a wrong scale (an O(1) loss change)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability 8.9+")
    common = [*COMMON, "model=small", "model.vocab_size=256", "model.attention=sdpa",
              f"data.root={markov_root}", f"runs_dir={tmp_path / 'runs'}", "budget.steps=20",
              "train.global_batch_size=16", "parallel.micro_batch_size=16",
              "optim.lr=3e-3", "schedule.warmup_steps=3", "train.eval_batches=2"]
    runs = run_group(tmp_path, common, 1, {
        "fp8": ["precision=fp8", "precision.fp8_filter=all"], "bf16": ["precision=bf16"]})
    fp8, bf16 = runs["fp8"], runs["bf16"]
    assert any(kind.startswith("Float8Linear") for kind in fp8["linears"].values())
    assert not any(kind.startswith("Float8Linear") for kind in bf16["linears"].values())
    assert len(fp8["losses"]) == len(bf16["losses"]) == 20
    for step, (a, b) in enumerate(zip(fp8["losses"], bf16["losses"], strict=True), 1):
        assert abs(a - b) <= 0.05, (step, a, b)
    # it learned, so the curves mean something. Measured on one H200 (torch 2.11, issue 49,
    # ../shared/gpu/README.md): bf16 fell 5.634 -> 5.353 in these 20 steps, 0.281, under
    # the 0.3 this asked before; 0.2 keeps a third of that as margin and still fails a run
    # that does not learn (ln 256 = 5.55 is where an untrained model sits)
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.2, bf16["losses"]


def test_an_async_checkpoint_from_gpu_memory_loads_back_bit_exactly(tmp_path):
    """Saved while the weights and optimizer state live on the GPU (staged into pinned host
    memory with non-blocking copies), twice with a step between (the stager reused where
    torch allows it); each loads back into GPU tensors bit for bit."""
    from pretrain.checkpoint.manager import CheckpointManager
    from pretrain.checkpoint.model_state import ModelOptimizer
    from pretrain.config.schema import CheckpointConfig, ModelConfig
    from pretrain.model.gpt import GPT

    device = torch.device("cuda")
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, seq_len=32, vocab_size=128)

    def pair(seed: int):
        torch.manual_seed(seed)
        with device:
            model = GPT(cfg)
            model.init_weights()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def train_step(model, opt):
        x = torch.randint(0, 128, (2, 32), device=device)
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, keep_last=5), device)
    saved = {}
    for step in (1, 2):
        train_step(model, opt)
        mgr.save(step, {"model_optim": ModelOptimizer(model, opt)}, {"step": step})
        saved[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                       {k: {n: t.clone() for n, t in s.items()}
                        for k, s in opt.state_dict()["state"].items()})
        train_step(model, opt)  # changes the GPU weights while the save is written
        mgr.wait()
    mgr.close()
    for step, (weights, state) in saved.items():
        other, other_opt = pair(1)
        train_step(other, other_opt)  # optimizer state exists to load into
        CheckpointManager.load(tmp_path / f"step_{step:07d}",
                               {"model_optim": ModelOptimizer(other, other_opt)})
        for name, value in other.state_dict().items():
            assert value.device.type == "cuda" and torch.equal(value, weights[name]), name
        for k, s in other_opt.state_dict()["state"].items():
            for n, t in s.items():
                assert torch.equal(t, state[k][n]), (step, k, n)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_offloaded_params_train_from_pinned_host_copies(markov_root, tmp_path, precision):
    """parallel.offload=params on one GPU: the parameters (FSDP2's shards) live in pinned
    host memory, each block's are copied to the GPU for its compute, and 3 steps train.
    fp32 on one process once met its batches on the GPU with its weights on the host."""
    t = trainer(markov_root, tmp_path, "model=small", "model.vocab_size=256",
                f"precision={precision}", "parallel.offload=params", "budget.steps=3",
                "train.global_batch_size=8", "parallel.micro_batch_size=4")
    try:
        params = t.module.parallel.parameters()
        assert params and all(isinstance(p, DTensor) for p in params)
        local = [p.to_local() for p in params]
        assert all(x.device.type == "cpu" and x.is_pinned() for x in local)
        losses = [t.train_step()[0] for _ in range(3)]
        assert all(x.device.type == "cpu" for x in (p.to_local() for p in params))
    finally:
        t.close()
    assert all(torch.isfinite(torch.tensor(losses)))


def test_bench_gpu_runs_one_cell(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_gpu.py"), "--models", "gpt2-124m",
         "--settings", "bf16-sdpa", "--steps", "3", "--warmup", "1", "--timeout", "400",
         "--out", str(out)], capture_output=True, text=True, timeout=480, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert "error" not in row and row["tokens_per_s"] > 0, row
    assert row["mfu"] is None or 0 < row["mfu"] < 1, row  # None: a GPU the table lacks
    assert "gpt2-124m" in (out / "results.md").read_text()


def test_simulate_a_1_3b_rank_within_10_percent_of_the_planner():
    """On the CUDA build: the fake step's forward/backward peak and its optimizer step
    peak, each against planning/memory.py (docs: tools/plan.py --simulate)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plan.py"), "+recipe=gpt3-1.3b",
         "precision=bf16", "parallel=zero3", "parallel.dp=8", "parallel.micro_batch_size=2",
         "train.global_batch_size=16", "train.compile=false", "--gpu", "h100-80gb",
         "--simulate", "--rank", "1"], capture_output=True, text=True, timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "4"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ratio = result["measured_over_planner"]
    assert ratio["step_peak_bytes"] == pytest.approx(1.0, abs=0.1), result
    assert ratio["optimizer_step_peak_bytes"] == pytest.approx(1.0, abs=0.1), result


def test_a_memory_snapshot_is_dumped_at_a_chosen_step_and_on_an_oom(markov_root, tmp_path):
    """profile.memory_snapshot (train/services/memory_snapshot.py): torch's allocator history
    dumped after step 2 (what pytorch.org/memory_viz reads: segments, and trace events with
    their Python frames), and again when an allocation fails."""
    import pickle
    from types import SimpleNamespace

    from pretrain.train.services.memory_snapshot import MemorySnapshot
    from pretrain.train.trainer import run

    cfg = compose_config([*COMMON, f"data.root={markov_root}", f"runs_dir={tmp_path}",
                          "model=nano", "model.vocab_size=256", "budget.steps=3",
                          "train.global_batch_size=8", "parallel.micro_batch_size=8",
                          "profile.memory_snapshot=true", "profile.memory_snapshot_steps=[2]",
                          "logging.wandb=disabled", "checkpoint.enabled=false"])
    run(cfg, tmp_path / "run")
    dumped = sorted(p.name for p in (tmp_path / "run" / "memory").iterdir())
    assert dumped == ["rank0_step2.pickle"]
    snap = pickle.loads((tmp_path / "run" / "memory" / "rank0_step2.pickle").read_bytes())
    assert snap["segments"]
    events = snap["device_traces"][torch.cuda.current_device()]
    assert any(e["action"] == "alloc" and e.get("frames") for e in events)

    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path / "oom", rank=0)
    hook = MemorySnapshot(ctx)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a petabyte
    finally:
        hook.close()
    assert (tmp_path / "oom" / "memory" / "rank0_oom.pickle").stat().st_size > 0
