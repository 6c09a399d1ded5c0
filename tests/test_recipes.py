"""Every recipe composes, validates and gives a dry-run plan; train.py prints it as JSON."""

from __future__ import annotations

import json
import math

import pytest
from helpers import CPU_RECIPES, GPU_RECIPES, RECIPES
from train_forks import train_py

from pretrain.budget.compute import count_params, flops_per_token
from pretrain.decision.checks import check
from pretrain.decision.resolve import resolve_plan

PLAN_KEYS = {"n_params", "n_params_non_embedding", "tokens", "steps", "global_batch_tokens",
             "flops_per_token", "total_flops", "attention", "precision", "layout",
             "checkpoint"}


def test_recipes_found():
    assert len(RECIPES) >= 10
    assert {"tiny", "gpt2-124m", "gpt3-125m", "llama-tiny"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_validates_and_plans(compose, recipe):
    cfg = compose([f"+recipe={recipe}"])
    assert cfg.run_name == recipe  # the deterministic run name is the recipe's
    check(cfg)
    plan = resolve_plan(cfg).plan
    assert PLAN_KEYS <= plan.keys()
    counts = count_params(cfg.model)
    assert plan["n_params"] == counts.total
    assert plan["n_params_non_embedding"] == counts.non_embedding
    assert plan["global_batch_tokens"] == cfg.train.global_batch_size * cfg.model.seq_len
    assert plan["tokens"] == plan["steps"] * plan["global_batch_tokens"]
    assert plan["flops_per_token"] == flops_per_token(cfg.model)
    assert plan["total_flops"] == pytest.approx(plan["flops_per_token"] * plan["tokens"])
    assert plan["attention"] == "sdpa"  # auto on this CPU
    if cfg.precision.name == "auto":  # decided for this machine, and said why
        assert plan["precision"] in ("bf16", "fp32") and plan["precision_auto"]
    else:  # a named precision is run exactly as named
        assert plan["precision"] == cfg.precision.name and "precision_auto" not in plan
    lay, par = plan["layout"], cfg.parallel
    dp = par.dp or 1  # dp=null (data parallel over the launched world): 1 in a dry run
    assert (lay["tp"], lay["pp"], lay["dp"]) == (par.tp, par.pp, dp)
    assert lay["world_size"] == par.tp * par.pp * dp  # multi-process recipes declare theirs
    mbs = cfg.parallel.micro_batch_size
    assert lay["grad_accum"] * mbs * dp == cfg.train.global_batch_size
    json.dumps(plan)  # the plan is printed as JSON: it must serialise
    # A GPU recipe saves by wall time: a crash of a weeks-long run loses at most half an
    # hour. The CPU recipes stay without periodic saves (a stop saves in any case).
    ck = cfg.checkpoint
    if recipe in CPU_RECIPES:
        assert not ck.enabled and ck.interval_minutes is None
        # (and where a WSD ladder keeps its branch points: recipes/ladder-tiny-wsd.yaml)
        assert plan["checkpoint"].startswith("on a stop only (checkpoint.enabled=false)")
    else:
        assert ck.enabled and ck.interval_minutes == 30 and ck.resume
        assert "every 30 min, on a stop, at the end" in plan["checkpoint"]


def test_gpu_recipes_are_the_cluster_sized_ones(compose):
    assert {"gpt3-6.7b", "gpt3-175b", "ladder-chinchilla", "isoflop", "llama-1b-fineweb",
            "gpt2-124m", "gpt3-1.3b-chinchilla"} <= set(GPU_RECIPES)
    assert set(CPU_RECIPES) <= set(RECIPES)
    assert not compose([]).checkpoint.enabled  # the default run writes no checkpoints


def test_recipe_values(compose):
    """Spot checks against the papers the recipes cite."""
    plan = resolve_plan(compose(["+recipe=gpt2-124m"])).plan
    assert plan["n_params"] == 124_439_808
    assert plan["steps"] == math.ceil(20 * 124_439_808 / (480 * 1024))  # Chinchilla, 0.5M batch
    plan = resolve_plan(compose(["+recipe=gpt3-125m"])).plan
    assert plan["global_batch_tokens"] == 524_288  # 0.5M tokens (Table 2.1)
    assert plan["steps"] == math.ceil(300e9 / 524_288)
    assert plan["lr"] == pytest.approx(6e-4)
    cfg = compose(["+recipe=gpt3-1.3b-chinchilla"])
    assert cfg.model.name == "gpt3-1.3b" and cfg.budget.kind == "tokens_per_param"
    plan = resolve_plan(cfg).plan
    assert plan["steps"] == math.ceil(20 * plan["n_params"] / (512 * 2048))
    # LLaMA 1B recipe: sqrt LR scaling from a 0.5M- to a 1M-token batch.
    plan = resolve_plan(compose(["+recipe=llama-1b-fineweb"])).plan
    assert plan["global_batch_tokens"] == 1_048_576
    assert plan["lr"] == pytest.approx(3e-3 * math.sqrt(2))


def test_cli_override_beats_recipe(compose):
    cfg = compose(["+recipe=gpt3-125m", "model.n_layer=6", "optim.lr=1e-3"])
    assert cfg.model.n_layer == 6 and cfg.model.d_model == 768
    assert cfg.optim.lr == 1e-3
    assert cfg.run_name == "gpt3-125m__model.n_layer=6,optim.lr=1e-3"


def test_default_config_is_the_tiny_recipe(compose):
    default, tiny = compose([]), compose(["+recipe=tiny"])
    assert default.run_name == "default"
    assert resolve_plan(default).plan == resolve_plan(tiny).plan


@pytest.mark.slow
def test_train_py_dry_run_prints_one_json_line(tmp_path):
    data_root, runs = tmp_path / "data", tmp_path / "runs"
    proc = train_py("+recipe=gpt3-125m", "dry_run=true", "logging=quiet",
                    f"data.root={data_root}", f"runs_dir={runs}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    plan = json.loads(lines[0])
    assert PLAN_KEYS <= plan.keys()
    assert plan["n_params"] == 125_226_240
    assert plan["steps"] == math.ceil(300e9 / 524_288)
    assert plan["precision"] == "bf16" and plan["attention"] == "sdpa"
    assert plan["checkpoint"] == "every 30 min, on a stop, at the end; keep last 3; async"
    assert not data_root.exists()  # a dry run touches no data
    assert not (runs / "gpt3-125m" / "metrics.jsonl").exists()

