"""End to end: train.py trains a nano GPT on a tiny local corpus, twice, in one run directory.
Each run is train.py in a fresh fork of a process that imported it (tests/train_forks.py);
a real interpreter start of train.py is tests/test_mixture.py's killed run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from built_once import built_once
from helpers import CORPUS_FILES, read_result, write_corpus
from train_forks import train_py

from pretrain.config.naming import run_name

STEPS, BATCH, SEQ, PEAK_LR, WARMUP = 30, 16, 64, 2e-3, 5
TRAIN_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_gb")


@pytest.fixture(scope="module")
def e2e(tmp_path_factory) -> dict:
    """Run the same command twice; return what each run left behind. Once per pytest run
    (tests/built_once.py)."""
    return built_once(tmp_path_factory, "e2e", run_twice)


def run_twice(work: Path) -> dict:
    write_corpus(work)
    runs = work / "runs"
    overrides = [
        "model=nano", "model.vocab_size=300", "data=local-text",
        f"data.data_files=[{','.join(CORPUS_FILES)}]", "data.tokenizer_vocab_size=300",
        "data.validation_fraction=0.1", "budget=steps", f"budget.steps={STEPS}",
        f"schedule.warmup_steps={WARMUP}", f"optim.lr={PEAK_LR}", "train.eval_batches=4",
        f"train.global_batch_size={BATCH}", f"parallel.micro_batch_size={BATCH}",
        "train.sample_tokens=16", "train.device=cpu",
        # neutral: these do not change the run directory's name
        "logging=quiet", f"data.root={work / 'data'}", f"runs_dir={runs}", "data.num_proc=1",
    ]
    out: dict = {"runs": runs, "overrides": overrides}
    for attempt in ("first", "second"):
        proc = train_py(*overrides, cwd=work, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        dirs = [p for p in runs.iterdir() if p.is_dir()]
        assert len(dirs) == 1, dirs  # the second run found the first one's directory
        run_dir = dirs[0]
        out[attempt] = {
            "dir": run_dir,
            "metrics": (run_dir / "metrics.jsonl").read_text(),
            "result": read_result(run_dir),
            "files": sorted(p.name for p in run_dir.iterdir()),
            "stdout": proc.stdout,
        }
    return out


@pytest.mark.slow
def test_run_directory_is_deterministic(e2e):
    expected = run_name(None, e2e["overrides"])
    assert expected.startswith("default__") and "runs_dir" not in expected
    assert e2e["first"]["dir"] == e2e["second"]["dir"] == e2e["runs"] / expected
    assert {"metrics.jsonl", "result.json", "plan.json"} <= set(e2e["first"]["files"])


def test_metrics_lines(e2e):
    lines = [json.loads(line) for line in e2e["second"]["metrics"].splitlines()]
    train = [m for m in lines if "loss" in m]
    assert [m["step"] for m in train] == [1, 10, 20, 30]
    for m in train:
        for key in TRAIN_KEYS:
            assert isinstance(m[key], (int, float)) and math.isfinite(m[key]), (key, m)
        assert m["tokens"] == m["step"] * BATCH * SEQ
        assert m["grad_norm"] > 0 and m["tokens_per_s"] > 0 and m["memory_gb"] > 0
        assert 0 < m["mfu"] < 1
    # The logged lr is the one for the next step: warmup (k+1)/5, cosine to 10% at the end.
    assert train[0]["lr"] == pytest.approx(PEAK_LR * 2 / WARMUP)
    progress = (10 - WARMUP + 1) / (STEPS - WARMUP)
    assert train[1]["lr"] == pytest.approx(
        PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))
    assert train[-1]["lr"] == pytest.approx(PEAK_LR * 0.1)
    evals = [m for m in lines if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, STEPS]


def test_loss_falls(e2e):
    result = e2e["second"]["result"]
    assert result["steps"] == STEPS and result["tokens"] == STEPS * BATCH * SEQ
    first, final = result["first_val_loss"], result["final_val_loss"]
    assert first == pytest.approx(math.log(300), abs=0.3)  # untrained: about uniform
    assert final < first - 1.5, (first, final)
    evals = [json.loads(x) for x in e2e["second"]["metrics"].splitlines() if "val_loss" in x]
    assert evals[-1]["val_loss"] == pytest.approx(final)
    assert result["sample"].startswith("def ")


def test_rerun_keeps_earlier_metrics_aside(e2e):
    run_dir = e2e["second"]["dir"]
    aside = sorted(run_dir.glob("metrics.*.jsonl"))
    assert len(aside) == 1, aside
    assert aside[0].read_text() == e2e["first"]["metrics"]
    # The second run's own log starts afresh (a fresh start, not appended).
    assert e2e["second"]["metrics"].count('"step": 0,') == 1
    # Same seed, same data order: the same losses.
    first = [json.loads(x)["loss"] for x in e2e["first"]["metrics"].splitlines() if '"loss"' in x]
    second = [json.loads(x)["loss"] for x in e2e["second"]["metrics"].splitlines()
              if '"loss"' in x]
    assert first == pytest.approx(second, abs=1e-4)
