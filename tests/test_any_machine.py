"""The project on whatever hardware it lands on: ``precision=auto``, the device choice that
cannot silently fall back to the CPU, and a CPU peak that makes MFU an honest fraction.

Nothing here depends on which CPU kind runs it: the capability checks are faked where a test
needs the other kind, and the one timing comparison has a 2x margin either way.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, one_thread, read_metrics

from pretrain.config.compose import compose_config
from pretrain.decision.resolve import resolve_plan
from pretrain.hardware import device as device_mod
from pretrain.hardware.device import DeviceError, measure_matmul_flops, pick_device
from pretrain.hardware.gpus import get_gpu
from pretrain.precision.policy import choose_auto, load_preset, resolve_auto_precision

CPU = torch.device("cpu")
GPU_ENV = ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_GPUS_ON_NODE",
           "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS", "SLURM_GPUS_PER_NODE",
           "SLURM_GPUS_PER_TASK")


@pytest.fixture
def no_gpu_env(monkeypatch):
    """A machine with no GPU evidence at all, whatever this one has."""
    for key in GPU_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(device_mod.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return monkeypatch


def fake_cpu(monkeypatch, capability: str, avx512_bf16: bool, amx: bool = False) -> None:
    monkeypatch.setattr(device_mod.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


def fake_gpu(monkeypatch, name: str, cc: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


# -- precision=auto ---------------------------------------------------------------------------


@pytest.mark.parametrize("capability,avx512_bf16,amx,isa,expected", [
    ("AVX2", False, False, None, "fp32"),          # AMD EPYC Zen 2/3, most laptops
    ("AVX512", False, False, None, "fp32"),        # Skylake/Cascade Lake: AVX512, no BF16
    ("AVX512", True, False, None, "bf16"),         # Cooper Lake, Zen 4
    ("AVX512", True, True, None, "bf16"),          # Sapphire Rapids (AMX)
    ("AVX2", True, True, None, "fp32"),            # ATEN_CPU_CAPABILITY=avx2 on such a CPU
    ("AVX512", True, False, "AVX2", "fp32"),       # ONEDNN_MAX_CPU_ISA=AVX2 on such a CPU
    ("AVX512", True, False, "AVX512_CORE_BF16", "bf16"),
])
def test_auto_on_a_cpu_is_bf16_only_with_native_bf16_matmuls(monkeypatch, capability,
                                                             avx512_bf16, amx, isa, expected):
    fake_cpu(monkeypatch, capability, avx512_bf16, amx)
    if isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    name, why = choose_auto(CPU)
    assert name == expected, why
    if expected == "fp32":
        assert why.startswith("this CPU has no native bf16 matmul (")
        if isa:
            assert f"ONEDNN_MAX_CPU_ISA={isa}" in why
    else:
        assert "AVX512-BF16" in why or "AMX" in why


@pytest.mark.parametrize("gpu,cc,expected,scaling", [
    ("NVIDIA H100 80GB HBM3", (9, 0), "bf16", False),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16", False),
    ("Tesla V100-SXM2-32GB", (7, 0), "fp16", True),
    ("Tesla T4", (7, 5), "fp16", True),
])
def test_auto_on_a_gpu_by_compute_capability(monkeypatch, gpu, cc, expected, scaling):
    fake_gpu(monkeypatch, gpu, cc)
    cfg, why = resolve_auto_precision(compose_config([]), torch.device("cuda"))
    p = cfg.precision
    assert (p.name, p.loss_scaling) == (expected, scaling)
    # exactly the preset's dtypes, from conf/precision/NAME.yaml
    assert p.compute_dtype == load_preset(expected).compute_dtype
    assert p.param_dtype == p.reduce_dtype == "float32"
    assert why.startswith(f"{expected}: {gpu} (compute capability {cc[0]}.{cc[1]})")


def test_auto_keeps_the_users_other_precision_keys(monkeypatch):
    fake_cpu(monkeypatch, "AVX512", True)
    cfg = compose_config(["precision.reduce_dtype=bfloat16"])
    out, why = resolve_auto_precision(cfg, CPU)
    assert (out.precision.name, out.precision.compute_dtype) == ("bf16", "bfloat16")
    assert out.precision.reduce_dtype == "bfloat16"
    assert cfg.precision.name == "auto"  # the input config is not modified


@pytest.mark.parametrize("named", ["fp32", "bf16", "fp16"])
def test_a_named_precision_is_run_exactly_as_named(monkeypatch, named):
    fake_cpu(monkeypatch, "AVX2", False)
    plan = resolve_plan(compose_config([f"precision={named}", "train.device=cpu"])).plan
    assert plan["precision"] == named and "precision_auto" not in plan


def test_default_and_cpu_recipes_are_auto_and_the_plan_says_why(monkeypatch):
    fake_cpu(monkeypatch, "AVX2", False)
    for recipe in ([], ["+recipe=tiny"], ["+recipe=llama-tiny"], ["+recipe=ladder-tiny"],
                   ["+recipe=isoflop-tiny"], ["+recipe=gpt2-124m-cpu"]):
        cfg = compose_config([*recipe, "train.device=cpu"])  # a GPU here would be auto's pick
        assert cfg.precision.name == "auto", recipe
        plan = resolve_plan(cfg).plan
        assert plan["precision"] == "fp32", recipe
        assert plan["precision_auto"].startswith("fp32: this CPU has no native bf16 matmul")
    fake_cpu(monkeypatch, "AVX512", True)
    assert resolve_plan(compose_config(["train.device=cpu"])).plan["precision"] == "bf16"
    # cluster recipes name their precision: bf16 wherever they land
    assert compose_config(["+recipe=gpt3-1.3b"]).precision.name == "bf16"


def test_planner_resolves_auto_from_the_gpu_table():
    cfg, why = resolve_auto_precision(compose_config([]), get_gpu("h100-80gb"))
    assert cfg.precision.name == "bf16" and "conf/gpu" in why
    out = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), "+recipe=tiny",
                          "--gpu", "a100-80gb", "--json"], capture_output=True, text=True,
                         timeout=120)
    plan = json.loads(out.stdout)
    assert plan["precision"] == "bf16" and plan["precision_auto"].startswith("bf16: a100-80gb")


def test_imitated_avx2_cpu_resolves_auto_to_fp32():
    """The environment that imitates an AVX2-only CPU on any x86 machine (what CI may
    get): a dry run of the default job plans fp32, and says why."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "dry_run=true",
                          "train.device=cpu"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert plan["precision"] == "fp32"
    assert plan["precision_auto"].startswith("fp32: this CPU has no native bf16 matmul")


@pytest.mark.parametrize("cap,user_dir,expected", [
    ("avx2", None, "torchinductor_{user}_avx2"),  # the imitation: a folder of its own
    ("", None, None),  # the machine's own kernels: inductor's default, untouched
    ("avx2", "/mine", "/mine"),  # a folder the user chose stays
])
def test_inductor_keeps_a_cache_per_cpu_capability(monkeypatch, cap, user_dir, expected):
    """Inductor's FX-graph cache key leaves out the vector ISA ``ATEN_CPU_CAPABILITY`` picks:
    an AVX512 run's cached graph came back under the AVX2 imitation as NaN gradients
    (tests/test_activation_checkpoint.py's fullgraph test), so each capability keeps its own."""
    import getpass
    import tempfile

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    if user_dir:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", user_dir)
    device_mod.inductor_cache_per_isa()
    got = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if expected is None:
        assert got is None
    elif expected.startswith("/"):
        assert got == expected
    else:
        assert got == os.path.join(tempfile.gettempdir(),
                                   expected.format(user=getpass.getuser()))


# -- the device -------------------------------------------------------------------------------


def test_gpus_that_cuda_cannot_use_are_an_error_under_a_launcher(no_gpu_env):
    no_gpu_env.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    no_gpu_env.setenv("WORLD_SIZE", "4")
    with pytest.raises(DeviceError) as e:
        pick_device("auto")
    msg = str(e.value)
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in msg and "train.device=cpu" in msg
    assert "WORLD_SIZE" in msg
    no_gpu_env.delenv("CUDA_VISIBLE_DEVICES")
    no_gpu_env.setenv("SLURM_JOB_ID", "42")
    no_gpu_env.setenv("SLURM_GPUS_ON_NODE", "8")
    with pytest.raises(DeviceError, match="SLURM_GPUS_ON_NODE=8"):
        pick_device("auto")
    no_gpu_env.setattr(device_mod.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    no_gpu_env.delenv("SLURM_GPUS_ON_NODE")
    with pytest.raises(DeviceError, match="/dev/nvidia0"):
        pick_device("auto")
    # asking for the CPU on purpose is always allowed
    assert pick_device("cpu") == CPU


def test_no_gpu_evidence_means_the_cpu_quietly(no_gpu_env, caplog):
    no_gpu_env.setenv("WORLD_SIZE", "4")
    no_gpu_env.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden on purpose
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert pick_device("auto") == CPU
    assert not caplog.records


def test_one_process_outside_a_launcher_warns_and_uses_the_cpu(no_gpu_env, caplog):
    no_gpu_env.setenv("CUDA_VISIBLE_DEVICES", "0")
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert pick_device("auto") == CPU
    assert "CUDA is not usable" in caplog.text and "train.device=cpu" in caplog.text
    with pytest.raises(DeviceError, match="CUDA is not usable"):
        pick_device("cuda")


# -- the CPU peak -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_peak_is_at_least_what_the_models_own_matmuls_reach(dtype):
    """MFU divides by this peak, so it must not sit below the rate of the matmuls a Linear
    really runs (x @ W^T forward, g @ W and g^T @ x backward). A peak timed on ``a @ b``
    alone did: an emulated bf16 GEMM runs 1.3 GFLOP/s that way and ~20 as ``a @ b^T`` on an
    AVX2 CPU, which gave MFU 195%. Checked against a Linear of the tiny model's shapes
    (batch 16 x 256 tokens, 192 -> 768), forward and backward, with a 2x margin. Both on
    the CPU and one thread, whatever else the machine has (a GPU box runs the suite with
    many workers on many cores: two timings at different thread contention compare
    nothing)."""
    x = torch.randn(16 * 256, 192, dtype=dtype, device=CPU, requires_grad=True)
    w = torch.randn(768, 192, dtype=dtype, device=CPU, requires_grad=True)

    def step():
        F.linear(x, w).sum().backward()

    with one_thread():
        step()
        best = min(_timed(step) for _ in range(3))
        peak = measure_matmul_flops(dtype, CPU, seconds=0.3)
    linear_rate = 3 * 2 * x.shape[0] * 192 * 768 / best  # forward + two backward matmuls
    assert peak >= 0.5 * linear_rate, (peak / 1e9, linear_rate / 1e9)


def test_a_run_handed_the_peak_measures_nothing_and_one_without_measures(monkeypatch):
    """PRETRAIN_CPU_PEAKS (what the test session hands its runs): the handed peak is the
    run's, with no matmul timed; without it (or for another thread count) the run measures."""
    from types import SimpleNamespace

    import pretrain.train.metrics as metrics

    timed = []
    monkeypatch.setattr(metrics, "measure_matmul_flops",
                        lambda dtype, device: timed.append(dtype) or 7e9)
    fp32 = SimpleNamespace(compute_dtype=torch.float32, name="fp32")
    threads = torch.get_num_threads()
    monkeypatch.setenv(metrics.CPU_PEAKS_ENV, json.dumps({
        metrics.peak_key(torch.float32, threads): 5e10,
        metrics.peak_key(torch.float32, threads + 1): 9e10}))
    monkeypatch.setattr(metrics, "_CPU_PEAKS", {})
    assert metrics.PeakFlops(CPU, fp32, 1, measure=True).value == 5e10 and timed == []
    monkeypatch.setattr(metrics, "_CPU_PEAKS", {})
    monkeypatch.delenv(metrics.CPU_PEAKS_ENV)
    assert metrics.PeakFlops(CPU, fp32, 1, measure=True).value == 7e9
    assert timed == [torch.float32]


def _timed(fn) -> float:
    import time

    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- a run: what it says, and its MFU -----------------------------------------------------------


def nano_run(compose, prepared, run_dir, precision: str):
    from pretrain.train.trainer import Trainer

    cfg = compose([
        "model=nano", "model.vocab_size=300", "model.seq_len=32", f"precision={precision}",
        "data.name=tinytext", f"data.root={prepared.parent}", "data.auto_prepare=false",
        "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
        "parallel.micro_batch_size=8", "budget=steps", "budget.steps=4",
        "schedule.warmup_steps=1", "logging=quiet", "logging.log_interval=1",
        "train.eval_batches=1", "train.eval_interval=100",
    ])
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    trainer.fit()
    return trainer, [m for m in read_metrics(run_dir) if "mfu" in m]


def test_bf16_named_on_a_cpu_without_it_warns_once_with_the_slowdown(
        compose, prepared, tmp_path, monkeypatch, caplog):
    import pretrain.train.metrics as metrics_mod

    monkeypatch.setattr(metrics_mod, "cpu_native_matmul",
                        lambda dtype: (False, "AVX2 CPU without AVX512-BF16 or AMX"))
    with caplog.at_level(logging.INFO, logger="pretrain"):
        trainer, metrics = nano_run(compose, prepared, tmp_path / "bf16", "bf16")
    assert trainer.policy.compute_dtype == torch.bfloat16  # run as named
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "precision=bf16 on a CPU without native bfloat16 matmuls" in warnings[0]
    assert re.search(r"for fp32, (\d+\.\d)x slower|faster than fp32 here", warnings[0]), \
        warnings[0]
    assert "precision=fp32" in warnings[0]
    assert all(0 < m["mfu"] <= 1 for m in metrics), [m["mfu"] for m in metrics]


@pytest.mark.parametrize(("peak", "fp32", "says"), [
    (14.8e9, 210e9, "14.8 GFLOP/s here against 210.0 for fp32, 14.2x slower"),
    (875e9, 210e9, "against 210.0 for fp32, faster than fp32 here all the same (4.2x)"),
    (14.8e9, 2.1e9, "faster than fp32 here all the same (7.0x)"),
])
def test_the_emulated_dtype_warning_never_says_0x_slower(peak, fp32, says):
    from pretrain.train.metrics import emulated_warning

    text = emulated_warning("fp16", torch.float16, "AVX2 CPU without AMX-FP16", peak, fp32,
                            "fp32")
    assert says in text and "0x slower" not in text


def test_auto_run_logs_what_it_became_and_its_mfu_is_a_fraction(compose, prepared, tmp_path,
                                                                caplog):
    with caplog.at_level(logging.INFO, logger="pretrain"):
        trainer, metrics = nano_run(compose, prepared, tmp_path / "auto", "auto")
    expected, why = choose_auto(CPU)
    assert trainer.plan["precision"] == expected
    assert trainer.plan["precision_auto"] == f"{expected}: {why}"
    first = [r.getMessage() for r in caplog.records][:2]
    assert first[0].startswith("plan: ") and '"precision_auto"' in first[0]
    assert first[1] == f"precision=auto -> {expected}: {why}"
    assert len(metrics) == 4 and all(0 < m["mfu"] <= 1 for m in metrics)
