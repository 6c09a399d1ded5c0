"""tools/bench_gpu.py without a GPU: the matrix composes into the configs it names and
resolves to budgets the run accepts (exactly the steps it times, well inside one epoch of the
embedded corpus), its dry run prints the commands, and the table and target verdicts come
out of the rows."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, compose_config

from pretrain.tools import bench_gpu


def test_every_cell_composes_to_the_setting_it_names():
    for model in bench_gpu.MODELS:
        batches = set()
        for setting in bench_gpu.SETTINGS:
            cfg = compose_config(bench_gpu.overrides(model, setting))
            assert cfg.model.name == model
            assert cfg.data.name == "stdlib" and cfg.model.vocab_size == 50257
            precision, *rest = setting.split("-")
            assert cfg.precision.compute_dtype == "bfloat16"
            assert cfg.precision.fp8 == (precision == "fp8")
            if precision == "fp8":
                assert cfg.precision.fp8_recipe == rest[0]
            assert cfg.model.attention == ("sdpa" if "sdpa" in rest else "auto")
            assert cfg.train.compile == ("compile" in rest or precision == "fp8")
            batches.add((cfg.parallel.micro_batch_size, cfg.train.global_batch_size))
        assert len(batches) == 1, f"{model}: settings compared at different batches {batches}"


# The embedded corpus's training tokens on CPython 3.11 (README's default run): the cells'
# budgets stay under one epoch of it. (Its exact size is known once it is prepared, when
# the run checks the epochs again; the recipes' own budgets were 1,048 epochs of it.)
STDLIB_TOKENS = 2_582_882


def test_every_cell_resolves_to_a_budget_the_run_accepts():
    for model in bench_gpu.MODELS:
        for setting in bench_gpu.SETTINGS:
            plan = bench_gpu.resolve_cell(model, setting, steps=20, warmup=5)
            assert plan["steps"] == 25, (model, setting)
            assert plan["tokens"] < STDLIB_TOKENS, (model, setting, plan)
            # prepared here already (another test ran it): the run's own check passes
            assert plan["epochs"] is None or plan["epochs"] < 1, (model, setting, plan)
            assert plan["layout"]["world_size"] == 1


def test_dry_run_prints_one_bench_command_per_cell():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench_gpu.py"), "--dry-run",
                           "--models", "gpt3-1.3b", "--steps", "7"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(bench_gpu.SETTINGS) + 1  # and the plain loop at the baseline
    assert all(line.startswith("python tools/bench.py +recipe=gpt3-1.3b ")
               and "budget=steps budget.steps=12 " in line
               and line.endswith("--steps 7 --warmup 5") for line in lines)
    assert sum(line.endswith("--modes plain --steps 7 --warmup 5") for line in lines) == 1
    assert any("precision=fp8 precision.fp8_recipe=rowwise model.attention=auto "
               "train.compile=true" in line for line in lines)
    assert "12 steps of 65,536 tokens" in proc.stderr
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "bench_gpu.py"), "--dry-run",
                          "--settings", "fp4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown settings ['fp4']" in bad.stderr


def row(model, setting, tokens_per_s, mfu):
    return {"model": model, "setting": setting, "command": f"python tools/bench.py {setting}",
            "tokens_per_s": tokens_per_s, "mfu": mfu, "micro_batch": 8, "global_batch": 32,
            "seq_len": 2048, "step_s": 65536 / tokens_per_s, "achieved_tflops": 400.0,
            "peak_tflops": 989.0, "peak_memory_gb": 61.5}


def test_table_and_targets_from_rows():
    rows = [row("gpt3-1.3b", "bf16-sdpa", 40_000, 0.37),
            row("gpt3-1.3b", "bf16-compile", 50_000, 0.455),
            {**row("gpt3-1.3b", "bf16-compile", 52_000, 0.47), "mode": "plain"},
            row("gpt3-1.3b", "fp8-tensorwise", 70_000, 0.64),
            row("gpt3-1.3b", "fp8-rowwise", 60_000, 0.55),
            {"model": "gpt2-124m", "setting": "fp8-rowwise", "command": "python x",
             "error": "RuntimeError: a | b"}]
    text = bench_gpu.markdown(rows, "NVIDIA H100")
    lines = text.splitlines()
    assert "| gpt3-1.3b | fp8-tensorwise | 8 x 4 x 2048 | 70,000 | 1.40x | 0.936 | 400.0 | " \
           "989 | 64.0% | 61.5 |" in lines
    assert "| gpt3-1.3b | bf16-sdpa | 8 x 4 x 2048 | 40,000 | 0.80x | 1.638 | 400.0 | " \
           "989 | 37.0% | 61.5 |" in lines
    assert "| gpt2-124m | fp8-rowwise | failed: RuntimeError: a \\| b | | | | | | | |" in lines
    assert "| gpt3-1.3b | bf16-compile (plain loop) | 8 x 4 x 2048 | 52,000 | 1.04x | " \
        "1.260 | 400.0 | 989 | 47.0% | 61.5 |" in lines
    assert "- gpt3-1.3b bf16-compile: MFU 45.5% (target >= 50%: NOT met)" in lines
    assert ("- gpt3-1.3b bf16-compile: the trainer at 0.96x the plain loop's tokens/s "
            "(target >= 1.0x: NOT met)") in lines
    assert ("- gpt3-1.3b fp8-tensorwise: 1.40x the tokens/s of bf16-compile "
            "(target >= 1.3x: met)") in lines
    assert ("- gpt3-1.3b fp8-rowwise: 1.20x the tokens/s of bf16-compile "
            "(target >= 1.3x: NOT met)") in lines
    # every row's command is there to rerun it
    assert lines[lines.index("```bash") + 1:lines.index("```bash") + 7] == \
        [r["command"] for r in rows]
