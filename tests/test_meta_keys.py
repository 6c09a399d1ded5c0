"""meta.json's keys are one list (checkpoint/folder.py META_KEYS): a real save writes exactly
those and each hook's state under its name, and the names a hook may not take
(train/services/__init__.py RESERVED) are that list."""

from __future__ import annotations

import json

import pytest

import pretrain.train.trainer as trainer_module
from pretrain.checkpoint.folder import META_KEYS
from pretrain.train.hooks import Hook
from pretrain.train.services import RESERVED, check_names

RUN = ["model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
       "data.name=tinytext", "data.auto_prepare=false", "data.tokenizer_vocab_size=300",
       "train.global_batch_size=8", "parallel.micro_batch_size=8", "budget=steps",
       "budget.steps=2", "logging=quiet", "logging.wandb=disabled", "train.eval_batches=1",
       "train.eval_interval=2", "train.sample_tokens=0", "schedule.warmup_steps=1",
       "checkpoint.enabled=true", "checkpoint.interval_steps=2",
       "checkpoint.async_save=false"]


def hook_names() -> set[str]:
    found, todo = set(), [Hook]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        found.add(cls.name)
    return found


def test_a_saves_meta_json_holds_the_listed_keys_and_hook_states(compose, prepared, tmp_path):
    trainer_module.run(compose([*RUN, f"data.root={prepared.parent}"]), tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_0000002" / "meta.json")
                      .read_text())
    assert META_KEYS <= set(meta), sorted(META_KEYS - set(meta))
    assert set(meta) - META_KEYS <= hook_names(), sorted(set(meta) - META_KEYS)


def test_no_hook_may_take_a_key_of_meta_json():
    assert RESERVED == META_KEYS
    for key in sorted(META_KEYS):
        hook = type("H", (Hook,), {"name": key})()
        with pytest.raises(ValueError, match="are taken"):
            check_names([hook])
