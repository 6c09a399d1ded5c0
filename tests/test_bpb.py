"""Bits per byte and validation per source (docs/bits-per-byte.md): preparation counts the
UTF-8 bytes of each split's text; a run evaluates every validation set it is given and
reports each in loss and bits per byte (metrics.jsonl, result.json), the bits per byte
exactly the loss times tokens over bytes over ln 2; data prepared without byte counts gives
a note, not a number; the scaling-law tool fits bits per byte on request."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import compose_config, make_data_config, read_metrics, read_result

from pretrain.data.loader import TokenWindows
from pretrain.data.prepare import encode, merge, plan, prepare
from pretrain.train.evaluation import (
    ValidationSource,
    bits_per_byte,
    mixture_mean,
    validation,
)
from pretrain.train.trainer import Trainer

# A second corpus with more bytes than characters: accents (2 bytes), a euro sign (3) and
# an emoji (4) in every line.
WORDS = ["café", "naïve", "über", "größe", "€uro", "tea☕", "fiancée", "smörgåsbord", "🙂"]


def other_texts() -> list[str]:
    rng = np.random.default_rng(0)
    return ["\n".join(" ".join(rng.choice(WORDS, size=8)) for _ in range(60)) + "\n"
            for _ in range(10)]


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """The second corpus prepared as ``other`` with the tiny corpus's settings (one
    validation document of ten); its data dir."""
    root = tmp_path_factory.mktemp("other")
    files = []
    for i, text in enumerate(other_texts()):
        files.append(str(root / f"d{i}.txt"))
        Path(files[-1]).write_text(text, encoding="utf-8")
    return prepare(make_data_config(root / "data", name="other", data_files=files))


def without_byte_counts(src: Path, dst: Path) -> Path:
    """A copy of a prepared corpus as one prepared before bytes were counted."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "index.json").read_text())
    for split in index["splits"].values():
        del split["bytes"]
    (dst / "index.json").write_text(json.dumps(index))
    return dst


def test_preparation_counts_the_utf8_bytes_of_each_splits_text(other):
    from tokenizers import Tokenizer

    texts = other_texts()
    index = json.loads((other / "index.json").read_text())
    splits = index["splits"]
    total = sum(len(t.encode("utf-8")) for t in texts)
    assert total > sum(len(t) for t in texts)  # bytes, not characters
    assert splits["train"]["bytes"] + splits["validation"]["bytes"] == total
    # the validation split's documents, read back from its shard (EOS-separated, a
    # byte-level BPE decodes exactly): their text's bytes, the EOS tokens not counted
    tok = Tokenizer.from_file(str(other / "tokenizer.json"))
    ids = np.fromfile(other / splits["validation"]["shards"][0]["file"], dtype=np.uint16)
    ends = np.flatnonzero(ids == index["eos_id"])
    assert len(ends) == splits["validation"]["documents"] == 1 and ends[-1] == len(ids) - 1
    docs = [tok.decode(d.tolist()) for d in np.split(ids, ends + 1)[:-1]]
    assert all(d in texts for d in docs)
    assert splits["validation"]["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    assert splits["validation"]["tokens"] == len(ids)  # tokens count the EOS
    windows = TokenWindows(other, "validation", 32, shuffle=False)
    assert windows.text_bytes() == (len(ids), splits["validation"]["bytes"])


def test_a_piece_encoded_before_bytes_were_counted_leaves_the_total_unknown(tmp_path,
                                                                            in_work_dir):
    cfg = make_data_config(tmp_path / "data")
    staging = plan(cfg)
    encode(cfg, 0, 1)
    marker = next((staging / "done").glob("*.json"))
    old = json.loads(marker.read_text())
    for part in old["splits"].values():
        del part["bytes"]
    marker.write_text(json.dumps(old))
    out = merge(cfg)
    index = json.loads((out / "index.json").read_text())
    assert all(s["bytes"] is None for s in index["splits"].values())
    assert TokenWindows(out, "validation", 8).text_bytes() is None


def nano_trainer(prepared: Path, run_dir: Path) -> Trainer:
    cfg = compose_config([
        "model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "model.attention=eager", "data.name=tinytext", f"data.root={prepared.parent}",
        "data.auto_prepare=false", "data.tokenizer_vocab_size=300",
        "train.global_batch_size=8", "parallel.micro_batch_size=8", "budget=steps",
        "budget.steps=3", "schedule.warmup_steps=1", "logging=quiet", "train.eval_batches=2",
        "checkpoint.enabled=false", "train.sample_tokens=0",
    ])
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    return trainer


def run(trainer: Trainer) -> dict:
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_one_source_reports_its_loss_unchanged_and_its_bits_per_byte(prepared, tmp_path):
    trainer = nano_trainer(prepared, tmp_path / "run")
    # one corpus is a mixture of one source: the one validator, evaluating it once
    assert list(trainer.validation.evaluators) == ["tinytext"]
    assert trainer.validation.sets["tinytext"] is trainer.val_data  # opened once
    result = run(trainer)
    tokens, nbytes = TokenWindows(prepared, "validation", 32).text_bytes()
    own = result["val/tinytext"]
    assert own["loss"] == result["final_val_loss"]
    assert own["bpb"] == result["final_val_bpb"] == result["final_val_loss"] * (
        tokens / nbytes) / math.log(2)
    evals = [m for m in read_metrics(tmp_path / "run") if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, 3]
    for m in evals:
        assert m["val_loss/tinytext"] == m["val_loss"]
        assert m["val_bpb/tinytext"] == bits_per_byte(m["val_loss"], tokens, nbytes)


def test_every_validation_set_is_evaluated_and_reported(prepared, other, tmp_path, caplog):
    old = without_byte_counts(other, tmp_path / "old")
    trainer = nano_trainer(prepared, tmp_path / "run")
    sources = [ValidationSource("tinytext", prepared, 1.0), ValidationSource("other", other, 0.5),
               ValidationSource("old", old, 0.0)]  # weight 0: validation only
    trainer.validation = validation(trainer.cfg, trainer.module, dp_rank=0,
                                    device=trainer.device, own=trainer.val_data,
                                    sources=sources)
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        result = run(trainer)
    assert any("bits per byte unavailable for 'old'" in r.getMessage() for r in caplog.records)
    counts = {n: TokenWindows(p, "validation", 32).text_bytes()
              for n, p in (("tinytext", prepared), ("other", other))}

    rows = [m for m in read_metrics(tmp_path / "run") if "val_loss" in m]
    assert [m["step"] for m in rows] == [0, 3]
    for m in rows:
        assert {"val_loss/tinytext", "val_loss/other", "val_loss/old", "val_bpb/tinytext",
                "val_bpb/other"} <= set(m) and "val_bpb/old" not in m
        assert m["val_loss/old"] == m["val_loss/other"]  # the same windows
        for n, (tokens, nbytes) in counts.items():
            assert m[f"val_bpb/{n}"] == m[f"val_loss/{n}"] * (tokens / nbytes) / math.log(2)
        # the run's val_loss: the training-weighted mean over the sources of weight > 0
        assert m["val_loss"] == math.fsum([m["val_loss/tinytext"], 0.5 * m["val_loss/other"]]) / 1.5

    saved = read_result(tmp_path / "run")
    assert saved == result
    last = rows[-1]
    for n in ("tinytext", "other"):
        assert saved[f"val/{n}"]["loss"] == last[f"val_loss/{n}"]
        assert saved[f"val/{n}"]["bpb"] == last[f"val_bpb/{n}"]
    assert saved["val/other"]["weight"] == 0.5 and saved["val/old"]["weight"] == 0.0
    assert saved["final_val_loss"] == last["val_loss"]
    assert saved["final_val_bpb"] == math.fsum(
        [last["val_bpb/tinytext"], 0.5 * last["val_bpb/other"]]) / 1.5
    # data prepared before bytes were counted: the note, never a number
    assert saved["val/old"]["bpb"] is None
    assert "prepare it again" in saved["val/old"]["bpb_unavailable"]
    assert saved["first_val_loss"] == rows[0]["val_loss"]


def test_bits_per_byte_are_unavailable_when_a_weighted_source_lacks_byte_counts(
        prepared, tmp_path):
    old = without_byte_counts(prepared, tmp_path / "data" / "tinytext")
    trainer = nano_trainer(old, tmp_path / "run")
    result = run(trainer)
    assert result["final_val_bpb"] is None and result["val/tinytext"]["bpb"] is None
    assert result["final_val_loss"] == result["val/tinytext"]["loss"]
    rows = [m for m in read_metrics(tmp_path / "run") if "val_loss" in m]
    assert rows and all("val_bpb/tinytext" not in m for m in rows)


def test_a_mixtures_validation_loss_is_the_mean_by_its_mixture_weights():
    """The one definition (evaluation.mixture_mean, docs/bits-per-byte.md): the sources of
    positive weight, weighted by data.mixture's weights; weight 0 is validation only; a
    weighted source without a value gives None; one source gives its value, bit for bit."""
    weights = {"web": 0.5, "code": 0.3, "books": 0.2, "held_out": 0.0}
    losses = {"web": 4.0, "code": 2.0, "books": 1.0, "held_out": 100.0}
    assert mixture_mean(losses, weights) == pytest.approx(
        (0.5 * 4.0 + 0.3 * 2.0 + 0.2 * 1.0) / (0.5 + 0.3 + 0.2), abs=1e-15)  # 2.8
    assert mixture_mean({**losses, "code": None}, weights) is None
    assert mixture_mean({**losses, "held_out": None}, weights) == mixture_mean(losses, weights)
    assert mixture_mean({"one": 3.2109876}, {"one": 1.0}) == 3.2109876
    # the weights' scale does not matter: 5/3/2 is the same mix
    assert mixture_mean(losses, {"web": 5, "code": 3, "books": 2}) == pytest.approx(2.8)


def test_log_line_shows_each_source_compactly():
    from pretrain.train.metrics import format_metrics

    line = format_metrics({"step": 5, "total_steps": 9, "val_loss": 4.1234,
                           "val_loss/web": 4.1234, "val_bpb/web": 1.23456,
                           "val_loss/code": 2.5})
    assert line == "step 5/9 | val_loss 4.1234 | val/web 4.1234 (1.235 bpb) | val/code 2.5000"


# -- the scaling-law fit on bits per byte ----------------------------------------------------


def write_sweep(root: Path, with_bpb: bool = True) -> list[tuple[float, float]]:
    """An iso-FLOP sweep of finished runs (Chinchilla's law, small noise) whose result.json
    holds final_val_bpb = final_val_loss x 0.3 / ln 2; the (loss, bpb) of each run."""
    from pretrain.analysis.scaling import CHINCHILLA

    rng = np.random.default_rng(0)
    out = []
    for c in np.logspace(18, 22, 5):
        n_opt, _ = CHINCHILLA.optimal(c)
        for k in np.linspace(-1, 1, 7):
            n = float(n_opt * 10**k)
            d = float(c / (6 * n))
            loss = float(CHINCHILLA.predict(n, d) * math.exp(rng.normal(0, 0.005)))
            run_dir = root / f"c{c:.0e}-n{n:.3e}"
            run_dir.mkdir(parents=True)
            (run_dir / "plan.json").write_text(json.dumps({"n_params": n, "tokens": d}))
            result = {"final_val_loss": loss, "tokens": d}
            if with_bpb:
                result["final_val_bpb"] = loss * 0.3 / math.log(2)
            (run_dir / "result.json").write_text(json.dumps(result))
            out.append((loss, result.get("final_val_bpb")))
    return out


def test_scaling_law_fits_bits_per_byte(tmp_path):
    pytest.importorskip("scipy")
    from pretrain.tools import scaling_law

    runs = write_sweep(tmp_path / "sweep")
    fits = {}
    for metric in ("val_loss", "val_bpb"):
        out = tmp_path / metric
        assert scaling_law.main([str(tmp_path / "sweep"), "--metric", metric, "--out", str(out),
                                 "--bootstrap", "0", "--no-plots"]) == 0
        fits[metric] = json.loads((out / "fit.json").read_text())
    loss, bpb = fits["val_loss"], fits["val_bpb"]
    assert loss["metric"] == "final_val_loss" and bpb["metric"] == "final_val_bpb"
    assert sorted(r["loss"] for r in bpb["runs"]) == sorted(b for _, b in runs)
    # a constant factor on the loss moves E (and A, B) by that factor, not the exponents
    factor = 0.3 / math.log(2)
    assert bpb["chinchilla_law"]["alpha"] == pytest.approx(loss["chinchilla_law"]["alpha"],
                                                            abs=0.02)
    assert bpb["chinchilla_law"]["E"] == pytest.approx(factor * loss["chinchilla_law"]["E"],
                                                        rel=0.05)


def test_scaling_law_says_which_runs_lack_bits_per_byte(tmp_path, capsys):
    from pretrain.tools import scaling_law

    write_sweep(tmp_path / "new")
    write_sweep(tmp_path / "old", with_bpb=False)
    code = scaling_law.main([str(tmp_path / "new"), str(tmp_path / "old"), "--metric",
                             "val_bpb", "--out", str(tmp_path / "out"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == 2
    assert "35 finished run(s) have no final_val_bpb" in err and str(tmp_path / "old") in err
    assert "--metric val_loss" in err and "prepare_data.py" in err
    assert not (tmp_path / "out" / "fit.json").exists()


def test_scaling_law_fits_a_tasks_bits_per_byte(tmp_path, capsys):
    """--metric task/<name>/bpb fits result.json's flat task key (train/downstream.py) like
    the loss; runs that did not score the task are named, with the ways to get it."""
    pytest.importorskip("scipy")
    from pretrain.tools import scaling_law

    write_sweep(tmp_path / "sweep")
    for result_path in (tmp_path / "sweep").rglob("result.json"):
        result = json.loads(result_path.read_text())
        result["task/hellaswag/bpb"] = result["final_val_loss"] * 0.5
        result_path.write_text(json.dumps(result))
    out = tmp_path / "fit"
    assert scaling_law.main([str(tmp_path / "sweep"), "--metric", "task/hellaswag/bpb",
                             "--out", str(out), "--bootstrap", "0", "--no-plots"]) == 0
    fit = json.loads((out / "fit.json").read_text())
    assert fit["metric"] == "task/hellaswag/bpb"
    assert fit["chinchilla_law"]["E"] > 0
    capsys.readouterr()
    code = scaling_law.main([str(tmp_path / "sweep"), "--metric", "task/arc_easy/bpb",
                             "--out", str(tmp_path / "none"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == 2 and "have no task/arc_easy/bpb" in err and "eval.tasks=[arc_easy]" in err
    with pytest.raises(SystemExit):
        scaling_law.main([str(tmp_path / "sweep"), "--metric", "task/hellaswag/acc"])
