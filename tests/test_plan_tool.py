"""tools/plan.py end to end (in process): verdicts, numbers, auto layouts, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from pretrain.hardware.gpus import get_gpu, gpu_for_device_name, load_gpus
from pretrain.tools import plan as plan_tool


@pytest.fixture(scope="module")
def plan_main():
    return plan_tool.main


def run(plan_main, capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fits_with_breakdown_and_time(plan_main, capsys):
    code, out, _ = run(plan_main, capsys, "+recipe=gpt3-1.3b", "--gpu", "h100-80gb",
                       "--gpus", "1", "--json")
    assert code == 0
    p = json.loads(out)
    assert p["fits"] and p["gpus"] == 1 and p["layout"]["world_size"] == 1
    assert p["memory_total_gib"] == pytest.approx(sum(p["memory_gib"].values()), abs=0.05)
    # fp32 master weights, fp32 grads, Adam's two fp32 moments: 16 bytes per parameter
    per_param = (p["memory_gib"]["parameters"] + p["memory_gib"]["gradients"]
                 + p["memory_gib"]["optimizer state"]) * 2**30 / p["n_params"]
    assert per_param == pytest.approx(16, rel=1e-3)
    # time = FLOPs / (GPUs x peak x MFU): 6N + 12 L h s per token (budget.py), H100 bf16
    # dense peak 989 TFLOP/s, default MFU 0.40
    seconds = p["total_flops"] / (1 * 989e12 * 0.40)
    assert p["time_days"] == pytest.approx(seconds / 86400)
    assert p["gpu_hours"] == pytest.approx(seconds / 3600)


def test_does_not_fit_says_what_to_change(plan_main, capsys):
    code, out, _ = run(plan_main, capsys, "+recipe=gpt3-1.3b", "parallel.micro_batch_size=32",
                       "--gpu", "a100-40gb", "--gpus", "1")
    assert code == 1
    assert "verdict: DOES NOT FIT" in out
    assert "parallel.activation_checkpointing=full" in out or "micro_batch_size=" in out
    assert "to fit, change one of:" in out


def test_auto_prints_ranked_candidates_and_why(plan_main, capsys):
    code, out, _ = run(plan_main, capsys, "+recipe=gpt3-1.3b", "model.pad_vocab_to=128",
                       "parallel=auto", "--gpus", "16", "--gpu", "h100-80gb", "--top", "3")
    assert code == 0
    assert "parallel=auto, top candidates" in out and "why #1:" in out
    assert out.count("s/step (compute") == 3


def test_auto_json_layout_is_valid(plan_main, capsys):
    from pretrain.config.compose import compose_config
    from pretrain.decision.checks import check

    code, out, _ = run(plan_main, capsys, "+recipe=gpt3-1.3b", "parallel=auto", "--gpus", "8",
                       "--gpu", "a100-80gb", "--json")
    assert code == 0
    p = json.loads(out)
    lay = p["layout"]
    keys = ("tp", "pp", "dp", "dp_mode", "pp_schedule", "virtual_stages", "micro_batch_size",
            "activation_checkpointing", "sequence_parallel")
    overrides = [f"parallel.{k}={str(lay[k]).lower()}" for k in keys]
    overrides += [f"parallel.dp_replicate={lay['dp_replicate']}",
                  f"parallel.dp_shard={lay['dp_shard']}"]
    check(compose_config(["+recipe=gpt3-1.3b", *overrides]), 8)  # raises if invalid


def test_unknown_gpu_lists_known_types(plan_main, capsys):
    code, _, err = run(plan_main, capsys, "+recipe=tiny", "--gpu", "b300")
    assert code == 2
    assert "unknown GPU type 'b300'" in err
    for name in ("h100-80gb", "h200-141gb", "a100-80gb", "a100-40gb", "l40s"):
        assert name in err


def test_impossible_gpu_count(plan_main, capsys):
    code, _, err = run(plan_main, capsys, "+recipe=gpt3-1.3b", "parallel=auto", "--gpus", "7")
    assert code == 2
    assert "no layout uses exactly 7 GPUs" in err and "nearby that work: " in err


def test_model_that_fits_no_layout(plan_main, capsys):
    code, _, err = run(plan_main, capsys, "+recipe=gpt3-6.7b", "parallel=auto", "--gpus", "2",
                       "--gpu", "a10g")
    assert code == 2
    assert "does not fit on 2 x a10g" in err and "GPUs of this type would fit it" in err
    # the presets pad the vocabulary to 128 rows: TP layouts are open, no advice to pad
    assert "tp=2" in err and "model.pad_vocab_to" not in err


def test_auto_needs_a_gpu_count_and_bad_mfu(plan_main, capsys):
    assert run(plan_main, capsys, "+recipe=tiny", "parallel=auto")[0] == 2
    code, _, err = run(plan_main, capsys, "+recipe=tiny", "--mfu", "1.5")
    assert code == 2 and "--mfu" in err


def test_layout_world_mismatch_is_a_config_error(plan_main, capsys):
    code, _, err = run(plan_main, capsys, "+recipe=tiny", "--gpus", "4")
    assert code == 2 and "world size is 4" in err


def test_user_gpu_file_extends_the_table(plan_main, capsys, tmp_path):
    (tmp_path / "x.yaml").write_text(
        "name: test-gpu-96gb\nmatch: [TESTGPU]\nmemory_gib: 96\n"
        "peak_tflops: {bfloat16: 500, float32: 50}\nnvlink_gbps: 100\nnetwork_gbps: 10\n")
    code, out, _ = run(plan_main, capsys, "+recipe=tiny", "--gpu", "test-gpu-96gb",
                       "--gpu-file", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["gpu_memory_gib"] == 96


def test_gpu_table_is_the_one_device_py_uses():
    """device.gpu_peak_flops reads the same table (matched by CUDA device name)."""
    assert {"h100-80gb", "h200-141gb", "a100-80gb", "a100-40gb", "l40s"} <= set(load_gpus())
    assert gpu_for_device_name("NVIDIA H100 80GB HBM3").peak_flops("bfloat16") == 989e12
    assert gpu_for_device_name("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert gpu_for_device_name("NVIDIA A100 80GB PCIe").name == "a100-80gb"
    assert gpu_for_device_name("NVIDIA L40S").peak_flops("float8") == 733e12
    assert get_gpu("a100-80gb").peak_flops("float8") is None
    assert gpu_for_device_name("Tesla T4") is None


def test_default_gpu_count_is_the_layouts_world_size(plan_main, capsys, monkeypatch):
    """Without --gpus the plan takes the layout's own size, the same formula a dry run and
    the trainer use (parallel.layout.layout_world_size): tp2 x pp2 x dp2 = 8."""
    from pretrain.config.compose import compose_config
    from pretrain.parallel.layout import declared_world_size, layout_world_size

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = compose_config(["+recipe=nano-3d"])
    code, out, _ = run(plan_main, capsys, "+recipe=nano-3d", "--json")
    assert code == 0
    p = json.loads(out)
    assert p["gpus"] == p["layout"]["world_size"] == 8
    assert layout_world_size(cfg.parallel) == declared_world_size(cfg) == 8


@pytest.mark.parametrize("device_name,gpu", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H100 96GB HBM3", "h100-96gb"),
    ("NVIDIA H200", "h200-141gb"), ("NVIDIA GH200 480GB", "gh200-96gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", "a10g"),
    ("NVIDIA B200", None), ("Tesla V100-SXM2-16GB", None)])
def test_gpu_names_match_exactly_one_type(device_name, gpu):
    """Whole words: the GH200 is not an H200 and the H100 PCIe not the SXM part; an unknown
    GPU matches nothing (never another type's peaks)."""
    from pretrain.hardware.gpus import gpu_for_device_name

    spec = gpu_for_device_name(device_name)
    assert (spec.name if spec else None) == gpu


def test_a_run_and_the_plan_take_mfu_against_the_same_peak():
    """fp8 runs included: the compute dtype's (bf16) peak, in the log and in the plan."""
    from pretrain.hardware.gpus import get_gpu
    from pretrain.precision.policy import load_preset, resolve_policy

    gpu = get_gpu("h100-80gb")
    for name in ("bf16", "fp16", "fp32", "fp8"):
        prec = load_preset(name)
        prec.fp8_allow_emulation = True
        policy = resolve_policy(prec, torch.device("cpu"))
        assert gpu.mfu_peak(policy.peak_dtype) == gpu.mfu_peak(prec.compute_dtype)
    assert gpu.mfu_peak("bfloat16") == 989e12 and gpu.mfu_peak("float32") == 67e12


def test_offloading_makes_gpt2_1_5b_fit_one_24gb_gpu_and_the_plan_says_what_moves(capsys):
    """GPT-2 1.5B on one A10G (22.5 GiB) at micro batch 1 with full checkpointing does not
    fit; the plan suggests parallel.offload=params (zero2 first: one copy of the weights a
    step), which fits, and states the host memory (parameters, gradients, AdamW state) and
    the bytes moved over PCIe."""
    from pretrain.tools import plan as plan_tool

    base = ["+recipe=gpt2-124m", "model=gpt2-1.5b", "--gpus", "1", "--gpu", "a10g",
            "parallel.micro_batch_size=1", "parallel.activation_checkpointing=full"]
    assert plan_tool.main([*base, "--json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert not plan["fits"] and "host_memory_gib" not in plan
    assert plan["suggestions"][0].startswith("parallel.offload=params parallel.dp_mode=zero2")
    assert plan_tool.main([*base, "parallel.offload=params", "parallel.dp_mode=zero2",
                           "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["fits"] and off["memory_gib"]["optimizer state"] == 0
    assert off["host_memory_gib"] == {k: plan["memory_gib"][k] for k in
                                      ("parameters", "gradients", "optimizer state",
                                       "optimizer step transient")}
    # FSDP2 reshards after each backward and, at dp=1, reduces each one: the fp32 shard
    # goes to the GPU and its gradient comes back once per micro batch (480 of them)
    assert off["offload_transfer_gb"] == pytest.approx(480 * 2 * 4 * 1_557_686_400 / 1e9,
                                                       rel=0.01)


def test_optimizer_only_offload_is_refused_naming_params(capsys):
    """FSDP2 has no optimizer-only offload: parallel.offload=optimizer is refused before
    any work, naming the offload that exists."""
    from pretrain.tools import plan as plan_tool

    assert plan_tool.main(["+recipe=gpt2-124m", "model=gpt2-1.5b", "--gpus", "1", "--gpu",
                           "a10g", "parallel.offload=optimizer"]) == 2
    err = capsys.readouterr().err
    assert "parallel.offload=optimizer: FSDP2 has no optimizer-only offload" in err
    assert "use parallel.offload=params" in err


def test_when_no_single_change_fits_the_memory_savers_together_with_offload_do(capsys):
    """gpt2-1.5b at the recipe's micro batch on one 24 GB GPU needs 85 GiB: no single change
    fits, full recomputation + micro batch 1 + offload to host memory together do."""
    from pretrain.tools import plan as plan_tool

    assert plan_tool.main(["+recipe=gpt2-124m", "model=gpt2-1.5b", "--gpus", "1", "--gpu",
                           "a10g"]) == 1
    out = capsys.readouterr().out
    assert "to fit, make these changes together:\n  parallel.activation_checkpointing=full " \
           "parallel.micro_batch_size=1 parallel.offload=params parallel.dp_mode=zero2 " \
           "(together) -> 5.37 GiB per GPU" in out
