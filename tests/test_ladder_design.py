"""The ladder's design, stated and checked before it runs (pretrain/analysis/ladder_design.py,
``tools/ladder.py --plan``), the byte ladder's recipes (heads at least 16 wide, branches that
find their source at any seed), a second seed in the ladder's streams, the seed spread in a
fit's interval, counts of N and a size left out of the fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pretrain.analysis.fit_checks import leave_size_out, seed_spread, with_seed_spread
from pretrain.analysis.ladder_design import (
    Design,
    Size,
    optimal_params,
    plan_runs,
    problems,
    render,
    trained_tokens,
)
from pretrain.analysis.runs import RunPoint, plan_params
from pretrain.analysis.scaling import ChinchillaLaw, Estimate
from pretrain.config.compose import compose_config
from pretrain.config.naming import heads, sweep_source
from pretrain.tools import ladder, scaling_law

BATCH = 2048


def size(width: int, n_layer: int = 4, head: int = 16, vocab: int = 257, rate=None) -> Size:
    """A size of a GPT whose counts follow 12 L d^2 + vocab d (close to the real ones)."""
    ne = 12 * n_layer * width * width + 13 * n_layer * width  # + biases and norms
    return Size(width, n_layer, max(1, width // head), ne + vocab * width, ne,
                6 * ne + 12 * n_layer * width * 128, 1e-2, rate)


def design(widths=(16, 24, 32, 48, 64, 72), multiples=(3.0, 6.0, 12.0, 24.0), tpp=20.0,
           ratio=30.0, rate=20_000.0, budget_h=None, sources=None, **kw) -> Design:
    sizes = [size(w, rate=rate, **kw) for w in widths]
    runs = plan_runs(sizes, list(multiples), 0.2, BATCH, [], 7)
    c_t = ratio * max(r.compute for r in runs)
    n_t = optimal_params(c_t, tpp)
    held = size(int(round(math.sqrt(n_t / 48) / 16)) * 16 or 16, rate=rate / 4)
    tokens = trained_tokens(held, c_t / (6 * held.n_params) / held.n_params, BATCH)
    return Design(sizes=sizes, multiples=list(multiples), decay_fraction=0.2,
                  batch_tokens=BATCH, seed_widths=[], ratio=ratio,
                  target_tpp=tokens / held.n_params, target_tpp_from="test", heldout=held,
                  heldout_compute=6 * held.n_params * tokens, heldout_tokens=tokens,
                  heldout_seconds=tokens / held.tokens_per_s, heldout_threads=2, jobs=2,
                  sources=sources or [{"name": "big", "weight": 1.0, "data_tokens": 1e12}],
                  runs=runs, budget_seconds=budget_h * 3600 if budget_h else None)


def test_a_sound_design_passes_and_states_every_run():
    d = design()
    assert problems(d) == []
    text = render(d, "ladder-bytes", "muP")
    assert "6 sizes" in text and "24 runs" in text
    assert len([ln for ln in text.splitlines() if " branch " in ln]) == 18
    assert "held-out: C = 30 x" in text and "tokens/param" in text


def test_runs_cost_what_they_train():
    """A branch trains only its decay (20%) from its branch point; the source its whole
    budget; tokens are whole batches; C = 6 N D of the tokens trained."""
    s = size(32, rate=10_000.0)
    runs = plan_runs([s], [3.0, 24.0], 0.2, BATCH, [32], 9)
    assert [(r.tokens_per_param, r.branch, r.seed) for r in runs] == [
        (3.0, True, None), (24.0, False, None), (3.0, True, 9), (24.0, False, 9)]
    src = runs[1]
    assert src.tokens % BATCH == 0 and src.tokens >= 24 * s.n_params > src.tokens - BATCH
    assert src.seconds == pytest.approx(src.tokens / 10_000)
    assert runs[0].seconds == pytest.approx(0.2 * runs[0].tokens / 10_000)
    assert src.compute == pytest.approx(6 * s.n_params * src.tokens)


@pytest.mark.parametrize("kw,needle", [
    ({"multiples": (3.0, 6.0, 12.0)}, "every rung is data-limited"),
    ({"multiples": (12.0, 24.0)}, "2 token multiple(s) per size"),
    ({"multiples": (24.0, 48.0, 96.0)}, "outside the multiples' span [24, 96]"),
    ({"widths": (32, 48, 64)}, "fewer than 5"),
    ({"widths": (32, 64)}, "2 size(s): L(N, D) needs at least 3"),
    ({"widths": (32, 40, 48, 56, 64)}, "span 3.9x in non-embedding parameters"),
    ({"widths": (16, 24, 32, 48, 72), "head": 8}, "heads narrower than 16"),
    ({"widths": (16, 24, 32, 48, 72), "vocab": 4096}, "the embedding is more than 25%"),
    ({"budget_h": 0.1}, "more than the budget's 0.10"),
    ({"sources": [{"name": "tiny", "weight": 0.5, "data_tokens": 1e6}]}, "tiny"),
])
def test_unidentifiable_or_unaffordable_designs_are_refused_with_the_knob(kw, needle):
    found = problems(design(**kw))
    assert any(needle in p for p in found), found
    knobs = ("--sizes", "branch_tokens_per_param", "budget.tokens_per_param", "n_head",
             "tokenizer_vocab_size", "--ratio", "corpus")
    assert all(any(k in p for k in knobs) for p in found), found


@pytest.mark.slow
def test_the_plan_tool_on_the_byte_ladder_recipe(capsys, monkeypatch):
    """``tools/ladder.py --plan`` composes the real recipe (counts, LR, branch points) and
    prints the design; it refuses a data-limited one with exit code 2. The second plan
    composes no size the first did not (a Hydra composition and a dry run each, 38 in all
    when composed again): each size is composed once here."""
    from pretrain.tools import ladder_plan

    composed, compose = {}, ladder_plan.compose_size

    def compose_once(recipe, width, overrides):
        key = (recipe, width, tuple(overrides))
        if key not in composed:
            composed[key] = compose(recipe, width, overrides)
        return composed[key]

    monkeypatch.setattr(ladder_plan, "compose_size", compose_once)
    args = ["--recipe", "ladder-bytes", "--sizes", "16,24,32,48,60,72", "--seed-sizes", "16,72",
            "--plan", "--no-measure", "--core-hours", "2"]
    assert ladder.main(args) == 0
    out = capsys.readouterr().out
    assert "6 sizes, 19.2x in non-embedding parameters" in out
    assert "4 layers, heads at least 16 wide" in out and "muP from base width 32" in out
    assert "    16      4     1   16    17,264    13,152  24%" in out
    assert "32 runs (2 size(s) with a second seed: 16, 72)" in out
    assert "held-out: C = 30 x 1.06e+13" in out and "width 176" in out
    assert ladder.main([*args, "--target-tpp", "40"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "every rung is data-limited" in err


def test_heads_at_least_16_wide():
    assert [heads(w, 16) for w in (16, 24, 32, 48, 60, 72, 176)] == [1, 1, 2, 3, 3, 4, 11]
    with pytest.raises(ValueError, match="d_model=70 does not split"):
        heads(70, 16)
    with pytest.raises(ValueError, match="d_model=8"):
        heads(8, 16)
    cfg = compose_config(["+recipe=ladder-bytes", "model.d_model=48"])
    assert (cfg.model.n_head, cfg.model.vocab_size, cfg.data.tokenizer_vocab_size) == (3, 257, 257)


def test_a_branch_finds_its_source_at_any_seed(monkeypatch):
    """The cooldown recipe's branch_from is the source sweep's point of the same overrides
    less the budget: the seed (or an LR) a sweep varies names the source too."""
    class Overrides:
        task = ["budget.tokens_per_param=3", "model.d_model=16", "train.seed=7",
                "data.root=/d", "runs_dir=/r"]

    class Hc:
        overrides = Overrides

    from hydra.core import hydra_config

    monkeypatch.setattr(hydra_config.HydraConfig, "get", staticmethod(lambda: Hc))
    assert sweep_source("/r/sweeps/x", "model.d_model=16") == \
        "/r/sweeps/x/model.d_model=16,train.seed=7"
    monkeypatch.undo()
    cfg = compose_config(["+recipe=ladder-bytes-cooldown", "model.d_model=24", "runs_dir=/r"])
    assert cfg.checkpoint.branch_from == "/r/sweeps/ladder-bytes/model.d_model=24"


def test_a_second_seed_runs_in_the_streams(capsys):
    assert ladder.main(["--recipe", "ladder-bytes", "--sizes", "16,32,72", "--seed-sizes", "72",
                        "--jobs", "2", "--dry-run", "--", "runs_dir=/r"]) == 0
    lines = capsys.readouterr().out.splitlines()
    seeded = [ln for ln in lines if "train.seed=7" in ln]
    assert len(seeded) == 2 and all("model.d_model=72 " in ln for ln in seeded)
    assert "+recipe=ladder-bytes-cooldown" in seeded[1]
    assert sum("model.d_model=" in ln for ln in lines) == 6


def test_seed_spread_widens_the_interval():
    pts = [RunPoint("a", 1e4, 1e5, 6e9, 2.0), RunPoint("b", 1e4, 1e5, 6e9, 2.02),
           RunPoint("c", 1e5, 1e6, 6e11, 1.5), RunPoint("d", 1e5, 1e6, 6e11, 1.485),
           RunPoint("e", 1e6, 1e6, 6e12, 1.2)]
    rel, groups = seed_spread(pts)
    assert groups == 2
    want = math.sqrt(sum(np.var(np.log(p), ddof=0) * 2 for p in ([2.0, 2.02], [1.5, 1.485])) / 2)
    assert rel == pytest.approx(want)
    est = Estimate(1.0, 0.001, 0.998, 1.002)
    wide = with_seed_spread(est, 0.01)
    assert wide.std == pytest.approx(math.hypot(0.001, 0.01))
    assert wide.low == pytest.approx(1 - 1.96 * wide.std) and wide.high > 1.019
    assert seed_spread(pts[:1]) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_counts_of_n_from_a_plan():
    plan = {"n_params": 17264, "n_params_active": 17264, "n_params_non_embedding": 13152,
            "flops_per_token": 201888}
    assert plan_params(plan) == 17264
    assert plan_params(plan, "non_embedding") == 13152
    assert plan_params(plan, "flops") == 201888 / 6
    with pytest.raises(ValueError, match="count 'x'"):
        plan_params(plan, "x")


def test_leaving_the_largest_size_out_predicts_it_from_the_rest():
    true = ChinchillaLaw(E=1.0, A=40.0, B=60.0, alpha=0.35, beta=0.3)
    pts = [RunPoint(f"{n}:{k}", n, k * n, 6 * k * n * n, float(true.predict(n, k * n)))
           for n in (1e4, 2e4, 4e4, 8e4, 1.6e5) for k in (3, 6, 12, 24)]
    law, errs = leave_size_out(pts, 1.6e5)
    assert len(errs) == 4 and all(abs(e) < 0.01 for _, e in errs)


def test_the_fit_reports_seeds_counts_and_sizes_left_out(tmp_path, capsys):
    """scaling_law on runs as train.py writes them: --count flops reads flops_per_token,
    --diagnose prints each size left out and every count, a repeated (N, D) is the seed
    spread, --predict-run reads a running run's plan."""
    true = ChinchillaLaw(E=1.0, A=40.0, B=60.0, alpha=0.35, beta=0.3)
    rng = np.random.default_rng(0)
    for w in (16, 24, 32, 48, 64):
        ne, n = 48 * w * w, 48 * w * w + 257 * w
        for k in (3, 6, 12, 24):
            for seed in ((1, 2) if w in (16, 64) else (1,)):
                run = tmp_path / "sweep" / f"w={w},k={k},s={seed}"
                run.mkdir(parents=True)
                plan = {"n_params": n, "n_params_active": n, "n_params_non_embedding": ne,
                        "flops_per_token": 6 * n + 12 * 4 * w * 128, "tokens": k * n,
                        "compute": 6 * k * n * n, "lr": 1e-2}
                loss = float(true.predict(n, k * n)) * (1 + 0.003 * rng.standard_normal())
                (run / "plan.json").write_text(json.dumps(plan))
                (run / "result.json").write_text(json.dumps(
                    {"final_val_loss": loss, "tokens": k * n, "final_lr": 0.0}))
    held = tmp_path / "held"
    held.mkdir()
    (held / "plan.json").write_text(json.dumps(
        {"n_params": 1e6, "n_params_active": 1e6, "n_params_non_embedding": 9.5e5,
         "flops_per_token": 6.2e6, "tokens": 2e7}))
    out = tmp_path / "fit"
    assert scaling_law.main([str(tmp_path / "sweep"), "--bootstrap", "10", "--no-plots",
                             "--out", str(out), "--diagnose", "--count", "flops",
                             "--predict-run", str(held)]) == 0
    text = capsys.readouterr().out
    fitted = json.loads((out / "fit.json").read_text())
    assert fitted["count"] == "flops"
    assert fitted["seed_spread"]["groups"] == 8
    assert 0.0005 < fitted["seed_spread"]["relative"] < 0.01
    assert "seed spread:" in text and "no prediction of one run can claim" in text
    (pred,) = fitted["predict"]
    assert pred["n_params"] == pytest.approx(6.2e6 / 6) and pred["tokens"] == 2e7
    assert pred["loss_with_seeds"]["std"] >= pred["loss"]["std"]
    assert set(fitted["count_check"]) == {"total", "non_embedding", "flops"}
    assert len(fitted["leave_size_out"]) == 5
    assert "each size left out of the fit" in text and "<- --count" in text
    assert [round(e["E"] / min(r["loss"] for r in fitted["runs"]), 2)
            for e in fitted["e_profile"]] == [0.0, 0.25, 0.5, 0.75]
    assert all(len(e["predict"]) == 1 for e in fitted["e_profile"])


def test_bytes_are_the_smallest_bpe(tmp_path):
    """tokenizer_vocab_size=257 is a byte-level tokenizer with no merges; less is refused
    before any text is read, naming the fix."""
    from pretrain.config.data_schema import DataConfig
    from pretrain.data.errors import DataError
    from pretrain.data.tokenizer import BYTE_VOCAB, make_tokenizer, train_bpe

    tok = train_bpe(["def f(x):\n    return x  # é\n"] * 50, BYTE_VOCAB)
    assert tok.get_vocab_size() == 257
    text = "héllo wörld"
    assert len(tok.encode(text).ids) == len(text.encode("utf-8"))
    with pytest.raises(DataError, match="data.tokenizer_vocab_size=257 model.vocab_size=257"):
        make_tokenizer(DataConfig(tokenizer_vocab_size=200), [])


@pytest.mark.slow
def test_a_real_byte_ladder_runs_branches_a_second_seed_and_predicts(tmp_path,
                                                                       monkeypatch):
    """The whole path at tiny scale with real training: tools/ladder.py runs recipes/
    ladder-bytes (on the standard library alone, in bytes) at three widths, their cooldown
    branches, a second seed of one width whose branches find their own source; then the fit
    with the seed spread and a prediction of a larger run from its plan. Kept small for CI:
    the first 300 files of the standard library, one layer, sources to 8 tokens/param (the
    branches' 1 and 4 below it; the recipe's 24 tripled the training for nothing checked;
    4 with branches at 1 and 2 left the fit policy nothing to predict with, issue 69). The
    streams' train.py commands run as tools/ladder.py starts them, side by side, each in a
    fork of a process that imported train.py's modules (tests/train_forks.py): six
    interpreter starts of torch and Hydra were a third of the test's CPU."""
    from train_forks import forked_processes

    runs = tmp_path / "runs"
    data = ["data.root=" + str(tmp_path / "data"),
            "data.mixture=[{name:stdlib,weight:1.0,source:stdlib,max_documents:300}]",
            "model.n_layer=1", "checkpoint.branch_tokens_per_param=[1,4]",
            "budget.tokens_per_param=8", "train.eval_batches=4", "train.device=cpu"]
    prep = compose_config(["+recipe=ladder-bytes", *data])
    from pretrain.data.mixture_prepare import prepare_mixture

    prepare_mixture(prep.data)
    out = tmp_path / "fit"
    with forked_processes() as processes:
        monkeypatch.setattr(ladder, "subprocess", processes)
        assert ladder.main(["--recipe", "ladder-bytes", "--sizes", "16,24,32", "--seed-sizes",
                            "16", "--jobs", "2", "--bootstrap", "8", "--no-plots", "--out",
                            str(out), "--predict", "1e5,4e5", "--", *data,
                            f"runs_dir={runs}"]) == 0
    fitted = json.loads((out / "fit.json").read_text())
    assert len(fitted["runs"]) == 12  # 4 widths-and-seeds x (source + 2 branches)
    assert fitted["seed_spread"]["groups"] == 3
    seeded = sorted(p.name for p in (runs / "sweeps" / "ladder-bytes-cooldown").iterdir()
                    if "train.seed=7" in p.name)
    assert len(seeded) == 2
    for name in seeded:
        branch = json.loads((runs / "sweeps" / "ladder-bytes-cooldown" / name /
                             "result.json").read_text())["branch"]
        source = Path(branch["source"]).name
        assert "model.d_model=16," in source and source.endswith("train.seed=7")
    if "refused" in fitted["chinchilla_law"]:  # three sizes: the policy's choice predicts
        (pred,) = fitted["policy"]["predict"]
        assert 0 < pred["loss"] < 6 and pred["interval"][0] < pred["loss"] < pred["interval"][1]
    else:
        (pred,) = fitted["predict"]
        assert 0 < pred["loss"]["value"] < 6 and "loss_with_seeds" in pred
