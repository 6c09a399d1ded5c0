"""Weighted mixtures of prepared corpora (src/pretrain/data/: weights.py, mixer.py,
mixture_windows.py, mixture_checks.py, source_checks.py; docs/mixtures.md):
every global batch holds each source's share to within one sample, the draw is a pure
function of the batch index (layouts and resumes agree), stages change the counts at their
step, the plan accounts per source, bad input is refused naming the key, and a run killed
with -9 resumes to the uninterrupted run's losses bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    REPO,
    VOCAB,
    by_step,
    compose_config,
    launch_env,
    wait_for,
    write_corpus,
    write_markov_data,
)
from train_forks import train_py

from pretrain.config.decision import SourceShare, WeightStage
from pretrain.config.schema import ConfigError
from pretrain.data.errors import DataError
from pretrain.data.loader import TokenWindows
from pretrain.data.mixer import BatchMixer
from pretrain.data.mixture_windows import MixtureWindows
from pretrain.data.source_checks import check_sources
from pretrain.data.weights import mixture_sources
from pretrain.decision.checks import check
from pretrain.decision.resolve import resolve_plan
from pretrain.optim.factory import wsd_decay_start

NAMES = ("web", "code", "books")
WEIGHTS = (0.5, 0.3, 0.2)
MIX = ("data=mixture", "data.mixture=[{name: web, weight: 0.5}, {name: code, weight: 0.3}, "
       "{name: books, weight: 0.2}]")


@pytest.fixture(scope="module")
def markov3(tmp_path_factory) -> Path:
    """Three prepared Markov-chain corpora (one vocabulary) under one data root."""
    root = tmp_path_factory.mktemp("mix")
    for k, name in enumerate(NAMES):
        write_markov_data(root / name, seed=k)
    return root


def windows(root: Path, batch: int, stages=((0, WEIGHTS),), seq_len: int = 16) -> MixtureWindows:
    sources = [TokenWindows(root / n, "train", seq_len, seed=7, stream=k + 1)
               for k, n in enumerate(NAMES)]
    typed = [WeightStage(step, tuple(w)) for step, w in stages]
    return MixtureWindows(sources, BatchMixer(typed, batch, 7))


@pytest.mark.parametrize("batch", [16, 10, 7])
def test_every_batch_holds_each_share_within_one_sample(markov3, batch):
    mix = windows(markov3, batch)
    counts = np.array([mix.mixer.counts(b) for b in range(200)])
    assert (counts.sum(1) == batch).all()
    assert (np.abs(counts - np.array(WEIGHTS) * batch) < 1).all()  # every batch, not a mean
    # and over the run: the running totals stay within one sample of the weights
    drift = np.cumsum(counts, 0) - np.outer(np.arange(1, 201), np.array(WEIGHTS) * batch)
    assert np.abs(drift).max() < 1
    # each source's samples are its own next ones: 0, 1, 2, ... none skipped or repeated
    seen = {k: [] for k in range(3)}
    for b in range(200):
        labels, local = mix.mixer.layout(b)
        for k in range(3):
            seen[k] += local[labels == k].tolist()
    for k in range(3):
        assert seen[k] == list(range(int(counts[:, k].sum())))


def test_samples_are_the_sources_windows_and_layouts_agree(markov3):
    batch, mix = 8, windows(markov3, 8)
    one = [mix.batch(b * batch, batch)[0] for b in range(20)]
    # dp=2: each rank reads its half of every global batch, in a fresh loader (no state)
    for rank in range(2):
        fresh = windows(markov3, batch)
        for b in range(19, -1, -1):  # any order: a resume starts anywhere
            x, _ = fresh.batch(b * batch + rank * batch // 2, batch // 2)
            assert (x == one[b][rank * batch // 2:(rank + 1) * batch // 2]).all()
    labels, local = mix.mixer.layout(3)
    src = TokenWindows(markov3 / NAMES[labels[0]], "train", 16, seed=7, stream=labels[0] + 1)
    assert (one[3][0].numpy() == src.window(int(local[0]))[:-1]).all()


def test_stages_change_the_counts_at_their_step_and_weight_zero_is_never_drawn(markov3):
    mix = windows(markov3, 10, stages=[(0, WEIGHTS), (30, (0.0, 0.5, 0.5))])
    counts = np.array([mix.mixer.counts(b) for b in range(60)])
    assert (np.abs(counts[:30] - np.array(WEIGHTS) * 10) < 1).all()
    assert (counts[30:] == [0, 5, 5]).all()
    # the batches before the stage are those of a run without it
    plain = windows(markov3, 10)
    for b in (0, 17, 29):
        assert (plain.batch(b * 10, 10)[0] == mix.batch(b * 10, 10)[0]).all()


def mixture_cfg(*extra: str):
    return compose_config(["model=nano", f"model.vocab_size={VOCAB}", *MIX, *extra])


def test_the_plan_accounts_per_source(markov3):
    cfg = mixture_cfg(f"data.root={markov3}", "budget=steps", "budget.steps=50",
                      "train.global_batch_size=10", "parallel.micro_batch_size=10")
    run = resolve_plan(cfg)
    plan = run.plan
    # what the run reads back is typed; plan.json is its serialised form
    assert run.decision.mixture_stages == (WeightStage(0, WEIGHTS),)
    assert run.decision.sources[0] == SourceShare("web", (0.5,), 250 * cfg.model.seq_len,
                                                  60_000)
    rows = {e["name"]: e for e in plan["data_sources"]}
    seq = cfg.model.seq_len
    assert [rows[n]["tokens"] for n in NAMES] == [250 * seq, 150 * seq, 100 * seq]
    assert rows["web"]["data_tokens"] == 60_000
    assert rows["code"]["epochs"] == round(150 * seq / 60_000, 3)
    assert plan["mixture_stages"] == [[0, list(WEIGHTS)]]
    with pytest.raises(ConfigError, match="data.mixture source web .* data.max_epochs=0.1"):
        resolve_plan(mixture_cfg(f"data.root={markov3}", "budget=steps", "budget.steps=50",
                                 "data.max_epochs=0.1"))


def test_a_cooldown_mix_applies_from_the_decay_start(markov3):
    cfg = mixture_cfg(f"data.root={markov3}", "budget=steps", "budget.steps=50", "schedule=wsd",
                      "++data.cooldown_weights={books: 1.0}")
    assert resolve_plan(cfg).plan["mixture_stages"] == [[0, list(WEIGHTS)], [40, [0.0, 0.0, 1.0]]]


@pytest.mark.parametrize("override, needle", [
    ("data.mixture=[{name: web, weight: -1}, {name: code, weight: 1}]", "negative weight"),
    ("data.mixture=[{name: web, weight: 0}, {name: code, weight: 0}]", "no source a positive"),
    ("data.stages=[{step: 10, weights: {web: 1}}, {step: 5, weights: {code: 1}}]",
     "strictly increasing"),
    ("data.stages=[{step: 10, weights: {wbe: 1}}]", "names ['wbe']"),
    ("data.data_files=[a.txt]", "data.data_files=['a.txt'] is a single-source key"),
    ("++data.cooldown_weights={web: 1}", "use schedule=wsd"),
])
def test_bad_mixture_config_names_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        check(mixture_cfg(override))
    assert needle in str(e.value)


def test_a_mixture_with_the_default_data_group_is_refused():
    cfg = compose_config([MIX[1]])  # data=stdlib's name and source
    with pytest.raises(ConfigError, match="data.name='stdlib' is a single-source key"):
        check(cfg)


EMPTY = "data.mixture is empty: data=mixture trains on the sources data.mixture lists"


def test_an_empty_mixture_is_refused_by_the_real_run_before_any_work(tmp_path):
    """Issue 51: ``data=mixture`` with no source used to try the Hugging Face hub for a
    dataset called "mixture" for half a minute. The real command (not a dry run) refuses
    at its decision step, naming data.mixture and the fix; no hub, no run directory."""
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "train.py", "data=mixture", "train.device=cpu",
                          f"runs_dir={tmp_path / 'runs'}", "logging=quiet"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    assert EMPTY in out.stderr and "'data.mixture=[{name: stdlib" in out.stderr
    assert "127.0.0.1" not in out.stdout + out.stderr  # the hub was never called
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.json"))


def test_an_emptied_recipe_mixture_says_it_is_empty():
    """``+recipe=mixture-tiny 'data.mixture=[]'``: the mixture is empty, not
    "data.cooldown_weights needs data.mixture" (the recipe's cooldown mix is not the
    problem)."""
    from pretrain.train.trainer import run

    cfg = compose_config(["+recipe=mixture-tiny", "data.mixture=[]", "dry_run=true"])
    with pytest.raises(ConfigError) as e:
        run(cfg, Path("unused"))
    assert e.value.problems == [e.value.problems[0]] and EMPTY in e.value.problems[0]
    assert "needs data.mixture" not in str(e.value)


def test_an_empty_mixture_is_refused_by_the_preparation(capsys):
    """tools/prepare_data.py data=mixture: the same line, exit 2, no hub."""
    from pretrain.tools import prepare_data

    assert prepare_data.main(["data=mixture"]) == 2
    assert EMPTY in capsys.readouterr().err


def test_a_missing_mixture_path_is_named_as_its_entry(tmp_path, capsys):
    """Issue 51: a mixture entry's local files that are not there are reported as
    ``data.mixture[i].data_files`` with the path (not ``data.data_files``), by the dry run
    and by the preparation, before any work."""
    from pretrain.tools import prepare_data
    from pretrain.train.trainer import run

    missing = str(tmp_path / "nowhere" / "*.txt")
    entries = (f"data.mixture=[{{name: web, weight: 1, source: text, "
               f"data_files: ['{missing}']}}]")
    cfg = compose_config(["model=nano", "data=mixture", entries, f"data.root={tmp_path}",
                          "dry_run=true"])
    with pytest.raises(ConfigError) as e:
        run(cfg, tmp_path / "dry")
    assert f"data.mixture[0].data_files (web) matches no file: ['{missing}']" in str(e.value)
    assert "data.data_files" not in str(e.value)
    assert prepare_data.main(["data=mixture", entries, f"data.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"data.mixture[0].data_files (web) matches no file: ['{missing}']" in err
    assert "data.data_files" not in err and not (tmp_path / "web").exists()


def test_bad_sources_are_listed_in_one_error(markov3, tmp_path):
    root = tmp_path / "data"
    write_markov_data(root / "web")
    (root / "code").mkdir()
    (root / "code" / "index.json").write_text(json.dumps(
        {"splits": {"train": {"tokens": 0, "shards": []}}, "vocab_size": 1, "eos_id": 0}))
    other = json.loads((markov3 / "web" / "index.json").read_text())
    write_markov_data(root / "books", seed=2)
    other["vocab_size"] = 999  # another vocabulary
    (root / "books" / "index.json").write_text(json.dumps(other))
    cfg = mixture_cfg(f"data.root={root}")
    assert [n for n, _, _ in mixture_sources(cfg.data)] == list(NAMES)
    with pytest.raises(DataError) as e:
        check_sources(cfg.data)
    text = str(e.value)
    assert "data.mixture[1].name=code" in text and "no training files" in text
    assert "['books'] have another tokenizer" in text
    (root / "code" / "index.json").unlink()
    with pytest.raises(DataError, match=r"data.mixture\[1\].name=code: no prepared data"):
        check_sources(cfg.data)


# -- end to end: three corpora prepared by the preparation job, one tokenizer -------------


@pytest.fixture(scope="module")
def prepared3(tmp_path_factory) -> Path:
    """The recipe's three sources, tiny, prepared by tools/prepare_data.py's job: the first
    trains the BPE, the others use its tokenizer.json."""
    from helpers import CORPUS_FILES, make_data_config

    from pretrain.data.prepare import prepare

    work = tmp_path_factory.mktemp("mixwork")
    write_corpus(work)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        first = prepare(make_data_config(work / "data", name="stdlib",
                                         data_files=CORPUS_FILES[:4]))
        for name, files in (("site-code", CORPUS_FILES[4:8]), ("site-docs", CORPUS_FILES[8:])):
            prepare(make_data_config(work / "data", name=name, data_files=files,
                                     tokenizer=str(first / "tokenizer.json")))
    finally:
        os.chdir(cwd)
    return work


def command(work: Path, run: str, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "+recipe=mixture-tiny", "model=nano",
            "model.vocab_size=300", f"data.root={work / 'data'}", "precision=fp32",
            "budget=steps", "budget.steps=12", "schedule.warmup_steps=2",
            "train.global_batch_size=10", "parallel.micro_batch_size=5",
            "train.eval_interval=1000", "train.eval_batches=1", "logging=quiet",
            "train.device=cpu", "logging.log_interval=1", f"runs_dir={work / 'runs'}",
            f"run_name={run}", *extra]


@pytest.mark.slow
def test_the_recipe_trains_and_a_killed_run_resumes_exactly(prepared3):
    work = prepared3
    straight = train_py(*command(work, "straight")[2:], cwd=work, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "site-docs: weight(s) 0.2/0.5" in straight.stdout + straight.stderr
    want = by_step(work / "runs" / "straight")
    assert sorted(want) == list(range(1, 13))
    plan = json.loads((work / "runs" / "straight" / "plan.json").read_text())
    cfg = compose_config(command(work, "straight")[2:])
    start = wsd_decay_start(12, cfg.schedule)  # the cooldown mix from the decay start
    assert plan["mixture_stages"] == [[0, [0.5, 0.3, 0.2]], [start, [0.2, 0.3, 0.5]]]
    # final_val_loss, by hand: the sources' last losses weighted by data.mixture's weights
    # (0.5/0.3/0.2), not by the cooldown stage's (0.2/0.3/0.5) the run ended on
    result = json.loads((work / "runs" / "straight" / "result.json").read_text())
    losses = [result[f"val/{n}"]["loss"] for n in ("stdlib", "site-code", "site-docs")]
    assert [result[f"val/{n}"]["weight"] for n in ("stdlib", "site-code", "site-docs")] == \
        [0.5, 0.3, 0.2]
    assert result["final_val_loss"] == pytest.approx(
        (0.5 * losses[0] + 0.3 * losses[1] + 0.2 * losses[2]) / 1.0, rel=1e-15)
    assert result["final_val_loss"] != pytest.approx(
        0.2 * losses[0] + 0.3 * losses[1] + 0.5 * losses[2], rel=1e-6)

    cmd = command(work, "killed", "checkpoint.enabled=true", "checkpoint.interval_steps=5",
                  "checkpoint.async_save=false")
    run_dir = work / "runs" / "killed"
    # a real start of train.py, killed; one OpenMP thread as train_py's forks have (the
    # resumed run is compared bit for bit with the straight one)
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=launch_env(OMP_NUM_THREADS="1"))
    step5 = run_dir / "checkpoints" / "step_0000005"
    wait_for(step5, proc)
    os.kill(proc.pid, signal.SIGKILL)  # the cooldown stage (step 9) is still ahead
    proc.wait()
    again = train_py(*cmd[2:], cwd=work, timeout=600)  # a fork of train.py: the same code
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    assert by_step(run_dir, pattern="metrics*.jsonl") == want  # bit for bit, fp32


def test_a_cooldown_branch_may_change_the_cooldown_mix_only():
    from omegaconf import OmegaConf

    from pretrain.checkpoint.branch import _differences

    source = mixture_cfg("schedule=wsd", "++data.cooldown_weights={web: 1.0}")
    saved = OmegaConf.to_container(OmegaConf.structured(source))
    assert _differences(saved, mixture_cfg("schedule=wsd",
                                           "++data.cooldown_weights={books: 1.0}")) == []
    other = mixture_cfg("schedule=wsd", "data.stages=[{step: 3, weights: {web: 1}}]")
    assert any(d.startswith("data.stages") for d in _differences(saved, other))
