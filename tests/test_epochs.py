"""Epochs: how often a budget goes through its corpus, from the prepared index or the size a
data config declares; above data.max_epochs a run is refused before any work starts."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import DATA_NAME, GPU_RECIPES, REPO, make_data_config

from pretrain.budget.compute import resolve_budget
from pretrain.config.schema import ConfigError
from pretrain.data.epochs import check_epochs, corpus_size
from pretrain.data.prepare import fingerprint
from pretrain.decision.resolve import resolve_plan


def budget_tokens(cfg) -> int:
    return resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size).tokens


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_every_gpu_recipe_fits_its_corpus_in_at_most_four_epochs(compose, recipe):
    cfg = compose([f"+recipe={recipe}"])
    entry = check_epochs(cfg.data, budget_tokens(cfg))
    assert entry["data_tokens_from"] == "declared" and entry["data_tokens"] > 0
    assert entry["epochs"] <= 4, (recipe, entry)


def test_gpt3_175b_dry_run_shows_the_corpus_and_its_epochs():
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "+recipe=gpt3-175b",
                          "dry_run=true"], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    plan = json.loads(out.strip().splitlines()[-1])
    assert plan["data"] == "fineweb-edu-350bt"
    # 300B tokens of a 350B-token sample less its validation share
    assert plan["data_tokens"] == int(350e9 * (1 - 0.00002))
    assert plan["epochs"] == pytest.approx(plan["tokens"] / plan["data_tokens"], abs=1e-3)
    assert 0.8 < plan["epochs"] < 0.9


def test_a_prepared_index_is_the_size_that_counts(prepared, in_work_dir):
    cfg = make_data_config(prepared.parent, tokens=10**12)  # a declared size, ignored
    index = json.loads((prepared / "index.json").read_text())
    size = corpus_size(cfg)
    assert (size.tokens, size.source) == (index["splits"]["train"]["tokens"], "prepared")
    # declared size and epoch limit do not change what is prepared
    assert fingerprint(cfg) == fingerprint(replace(cfg, tokens=None, max_epochs=99))


def test_ten_epochs_are_refused_naming_max_epochs(prepared, in_work_dir, caplog):
    cfg = make_data_config(prepared.parent)
    n = corpus_size(cfg).tokens
    with pytest.raises(ConfigError, match=r"10\.0 epochs .* data.max_epochs=4"):
        check_epochs(cfg, 10 * n)
    assert check_epochs(replace(cfg, max_epochs=12), 10 * n)["epochs"] == 10
    with caplog.at_level(logging.WARNING):
        assert check_epochs(cfg, 3 * n)["epochs"] == 3
    assert "goes 3.00 times through" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_epochs(cfg, n // 2)
    assert caplog.text == ""


def test_the_plan_refuses_a_ten_epoch_budget(prepared, in_work_dir, compose):
    files = ",".join(f"corpus/doc{i:02d}.txt" for i in range(10))
    args = ["model=nano", "model.vocab_size=300", "data=local-text", f"data.name={DATA_NAME}",
            f"data.data_files=[{files}]", "data.tokenizer_vocab_size=300",
            "data.validation_fraction=0.1", "data.num_proc=1",
            f"data.root={prepared.parent}", "budget=tokens"]
    n = corpus_size(make_data_config(prepared.parent)).tokens
    with pytest.raises(ConfigError, match="data.max_epochs"):
        resolve_plan(compose([*args, f"budget.tokens={10 * n}"]))
    plan = resolve_plan(compose([*args, f"budget.tokens={n}"])).plan
    assert plan["data_tokens_from"] == "prepared"
    assert plan["epochs"] == pytest.approx(1, abs=0.05)  # budget rounds up to whole steps


def test_an_undeclared_unprepared_corpus_has_unknown_epochs(tmp_path):
    cfg = make_data_config(tmp_path / "nothing")
    assert check_epochs(cfg, 10**12) == {"data_tokens": None, "data_tokens_from": "unknown",
                                          "epochs": None}
