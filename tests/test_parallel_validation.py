"""Every layout mistake is refused before any process group exists, one message each,
naming the key and a fix; dry runs check the layout as declared."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, problems
from hydra.errors import ConfigCompositionException

from pretrain.decision.checks import check
from pretrain.decision.resolve import resolve_plan

# A layout that is sound on 8 processes: tp2 x pp2 x dp2, nano model, 2 microbatches.
BASE = ["model=nano", "parallel=3d", "train.global_batch_size=16", "parallel.micro_batch_size=4"]


def only_problem(compose, overrides: list[str], world_size: int | None = 8) -> str:
    found = problems(compose([*BASE, *overrides]), world_size)
    assert len(found) == 1, found
    return found[0]


def test_base_layout_is_sound(compose):
    cfg = compose(BASE)
    check(cfg, 8)
    plan = resolve_plan(cfg, 8).plan
    assert plan["layout"]["world_size"] == 8 and plan["layout"]["microbatches"] == 2


@pytest.mark.parametrize("world_size", [1, 4, 16])
def test_world_size_must_equal_tp_pp_dp(compose, world_size):
    msg = only_problem(compose, [], world_size)
    assert "tp=2 x pp=2 x dp=2 needs 8 processes" in msg
    assert f"world size is {world_size}" in msg and "--nproc_per_node=8" in msg


def test_dp_left_out_is_the_rest_of_the_world(compose):
    cfg = compose([*BASE, "parallel.dp=null", "train.global_batch_size=32"])
    assert resolve_plan(cfg, 16).plan["layout"]["dp"] == 4
    msg = problems(cfg, 6)[0]  # 6 is not a multiple of tp*pp = 4
    assert "the world size 6 is not a multiple of tp=2 x pp=2 = 4" in msg


def test_heads_divisible_by_tp(compose):
    msg = only_problem(compose, ["model.n_head=2", "parallel.tp=4", "parallel.dp=1"])
    assert "model.n_head=2 is not divisible by parallel.tp=4" in msg
    check(compose([*BASE, "model.n_head=4", "parallel.tp=4", "parallel.dp=1"]), 8)


def test_kv_heads_divisible_by_tp(compose):
    msg = only_problem(compose, ["model.n_head=4", "model.n_kv_head=1"])
    assert "model.n_kv_head=1 is not divisible by parallel.tp=2" in msg


def test_vocab_divisible_by_tp_suggests_padding(compose):
    msg = only_problem(compose, ["model.vocab_size=4097", "data.tokenizer_vocab_size=4097"])
    assert "vocabulary (4097 rows) is not divisible by parallel.tp=2" in msg
    assert "model.pad_vocab_to=64" in msg
    check(compose([*BASE, "model.vocab_size=4097", "data.tokenizer_vocab_size=4097",
                   "model.pad_vocab_to=64"]), 8)  # the suggested fix works


def test_layers_divisible_by_stages(compose):
    msg = only_problem(compose, ["model.n_layer=3"])
    assert "model.n_layer=3 is not divisible by parallel.pp=2 x parallel.virtual_stages=1" in msg
    msg = only_problem(compose, ["parallel.pp_schedule=interleaved_1f1b",
                                 "parallel.virtual_stages=2", "model.n_layer=6"])
    assert "= 4 pipeline stages" in msg


def test_microbatches_at_least_pipeline_stages(compose):
    msg = only_problem(compose, ["parallel.micro_batch_size=8"])  # 16 / (8 x 2) = 1
    assert "pipeline gets 1 microbatch(es)" in msg and "at least parallel.pp=2" in msg


def test_global_batch_divisible_by_micro_batch_times_dp(compose):
    msg = only_problem(compose, ["train.global_batch_size=20"])
    assert (
        "train.global_batch_size=20 is not divisible by parallel.micro_batch_size=4 x dp=2" in msg
    )


def test_sequence_parallel_needs_tp(compose):
    msg = only_problem(compose, ["parallel.tp=1", "parallel.dp=4", "train.global_batch_size=32"])
    assert "parallel.sequence_parallel=true needs parallel.tp > 1" in msg


def test_unknown_schedule(compose):
    with pytest.raises(ConfigCompositionException) as e:
        compose([*BASE, "parallel.pp_schedule=dualpipe"])
    msg = str(e.value)
    assert "parallel.pp_schedule" in msg
    # one line (config/naming.py): the value, the key and its options
    assert "'dualpipe' is not a value of parallel.pp_schedule; the options: gpipe, 1f1b, " \
        "interleaved_1f1b, zbv" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["parallel.pp_schedule=zbv"], "zbv runs exactly 2 stages per rank"),
        (["parallel.pp_schedule=interleaved_1f1b"], "needs parallel.virtual_stages >= 2"),
        (["parallel.virtual_stages=2", "model.n_layer=4"], "runs one stage per rank"),
        (
            [
                "parallel.pp_schedule=zbv",
                "parallel.virtual_stages=2",
                "model.n_layer=4",
                "train.compile=true",
            ],
            "which torch.compile does not support",
        ),
        (
            ["parallel.dp_mode=zero3", "parallel.dp_replicate=3"],
            "parallel.dp_replicate=3 must divide dp=2",
        ),
        (["parallel.dp_replicate=2", "parallel.dp_shard=2"], "must equal dp=2; set dp_shard=1"),
        (["model.seq_len=63"], "use a seq_len divisible by 2"),
        (["model.d_ff=255"], "the MLP width 255 (model.d_ff) is not divisible by parallel.tp=2"),
        (
            ["parallel.dp_mode=ddp", "parallel.offload=params"],
            "DDP (parallel.dp_mode=ddp) has none",
        ),
        (["parallel.offload=params", "optim=muon"], "use optim=adamw or"),
    ],
)
def test_other_layout_errors(compose, overrides, needle):
    assert needle in only_problem(compose, overrides)


def test_all_layout_problems_reported_together(compose):
    found = problems(compose([*BASE, "model.n_layer=3", "model.n_head=3", "model.d_model=96",
                              "train.global_batch_size=12"]), 4)
    assert len(found) == 5, found  # world size, heads, layers, batch, microbatches


def test_check_without_world_size_uses_the_declared_layout(compose, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check(compose(BASE))  # 8 processes declared, none launched: a dry run checks the recipe
    monkeypatch.setenv("WORLD_SIZE", "4")  # under a launcher, its world size counts
    assert "world size is 4" in problems(compose(BASE))[0]


def test_dry_run_prints_the_declared_layout():
    out = subprocess.run(
        [sys.executable, "train.py", "+recipe=nano-3d", "dry_run=true", "logging=quiet"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    layout = json.loads(out.strip().splitlines()[-1])["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["world_size"]) == (2, 2, 2, 8)
    assert layout["sequence_parallel"] and layout["microbatches"] == 2


def test_auto_search_proposes_exactly_the_layouts_validation_accepts(compose):
    """``parallel=auto`` filters with the rules ``check`` reports: every layout it proposes
    passes validation, and every layout of its search space that it leaves out is one that
    validation refuses (or outside the search: tp beyond a node, partial rounds for a
    multi-stage schedule). train.compile=true rules ZB-V out for both."""
    import itertools

    from pretrain.config.schema import ParallelConfig
    from pretrain.hardware.gpus import get_gpu
    from pretrain.planning import autolayout as al

    cfg = compose(["model=nano", "model.n_layer=4", "train.global_batch_size=16",
                   "train.compile=true"])
    gpu = get_gpu("h100-80gb")
    found = list(al.enumerate_parallel(cfg, 8, gpu))
    assert found and all(p.pp_schedule != "zbv" for p in found)
    for tp, pp, mbs in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), al.MICRO_BATCHES):
        if 8 % (tp * pp):
            continue
        dp = 8 // (tp * pp)
        for (sched, v), (mode, rep, shard) in itertools.product(al._schedules(pp),
                                                                al._dp_modes(dp, tp, gpu)):
            par = ParallelConfig(name="auto", tp=tp, pp=pp, dp=dp, dp_mode=mode,
                                 dp_replicate=rep, dp_shard=shard, pp_schedule=sched,
                                 virtual_stages=v, micro_batch_size=mbs,
                                 sequence_parallel=tp > 1)
            if par in found:
                check(al.with_parallel(cfg, par), 8)
            elif al._whole_rounds(par, 16) and tp <= gpu.gpus_per_node:
                assert problems(al.with_parallel(cfg, par), 8), par
