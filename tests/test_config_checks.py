"""Bad input fails early with one clear message that names the key (and a fix)."""

from __future__ import annotations

import pytest
from helpers import CORPUS_FILES, RECIPES, problems
from hydra.errors import ConfigCompositionException, MissingConfigException

from pretrain.data.prepare import DataError
from pretrain.decision.checks import check
from pretrain.decision.resolve import resolve_plan
from pretrain.model.attention import AttentionBackendError
from pretrain.train.trainer import Trainer, run


def test_unknown_recipe_names_the_nearest(compose):
    """One line (config/naming.check_override_values): the three nearest recipes; every
    recipe is still the exception's ``options``."""
    with pytest.raises(MissingConfigException) as e:
        compose(["+recipe=tiny-zro3"])
    (line,) = e.value.lines()
    assert "no recipe named 'tiny-zro3' in recipes/; the nearest: tiny-zero3," in line
    assert e.value.options == RECIPES


def test_unknown_model_preset_names_the_nearest(compose):
    with pytest.raises(MissingConfigException, match=r"model option named 'nanoo'.*nano"):
        compose(["model=nanoo"])


@pytest.mark.parametrize("override,key", [
    ("model.n_layr=3", "model.n_layr"),
    ("trian.seed=3", "trian.seed"),
])
def test_misspelt_key_is_an_error(compose, override, key):
    with pytest.raises(ConfigCompositionException) as e:
        compose([override])
    text = f"{e.value} {e.value.__cause__}"
    assert key in text


@pytest.mark.parametrize("override", ["+model.n_layr=3", "+train.sed=3"])
def test_misspelt_key_with_plus_is_an_error(compose, override):
    with pytest.raises(Exception) as e:  # noqa: B017 - any error that names the key
        compose([override])
    assert override.split(".")[1].split("=")[0] in str(e.value)


def test_wrong_type_names_the_key(compose):
    with pytest.raises(ConfigCompositionException) as e:
        compose(["model.n_layer=three"])
    assert "n_layer" in f"{e.value} {e.value.__cause__}"


@pytest.mark.parametrize("override,key", [
    ("model.n_layer=0", "model.n_layer"),
    ("model.n_head=-2", "model.n_head"),
    ("model.d_model=0", "model.d_model"),
    ("model.seq_len=0", "model.seq_len"),
    ("model.vocab_size=-1", "model.vocab_size"),
    ("train.global_batch_size=0", "train.global_batch_size"),
    ("parallel.micro_batch_size=0", "parallel.micro_batch_size"),
])
def test_non_positive_sizes(compose, override, key):
    found = problems(compose(["model=nano", override]))
    value = override.split("=")[1]
    assert any(p.startswith(f"{key}={value} must be a positive") for p in found), found


def test_heads_must_divide_width(compose):
    (p,) = problems(compose(["model=nano", "model.n_head=3"]))
    assert "model.n_head=3 does not divide model.d_model=64" in p


def test_kv_heads_must_divide_heads(compose):
    (p,) = problems(compose(["model=nano", "model.n_head=4", "model.n_kv_head=3"]))
    assert "model.n_kv_head=3" in p and "model.n_head=4" in p


def test_global_batch_divisible_by_micro_batch(compose):
    (p,) = problems(compose(["train.global_batch_size=10", "parallel.micro_batch_size=4"]))
    assert "train.global_batch_size=10" in p and "parallel.micro_batch_size=4" in p
    assert "multiple of 4" in p  # the fix


def test_all_problems_reported_together(compose):
    found = problems(compose(["model=nano", "model.n_layer=0", "model.n_head=3",
                              "model.dropout=1.5"]))
    assert len(found) == 3
    assert any("model.dropout=1.5 must be in [0, 1)" in p for p in found)


@pytest.mark.parametrize("overrides,needle", [
    (["optim.lr_scaling=sqrt"], "optim.ref_batch_tokens"),
    (["schedule.warmup_tokens=1000"], "schedule.warmup_steps or schedule.warmup_tokens"),
    (["precision=fp32", "precision.loss_scaling=true"], "precision.loss_scaling"),
    (["precision=fp8", "precision.compute_dtype=float16"], "compute_dtype=float16"),
])
def test_other_config_errors(compose, overrides, needle):
    found = problems(compose(overrides))
    assert any(needle in p for p in found), found


def test_bpe_larger_than_model_vocab(compose):
    (p,) = problems(compose(["model=nano", "model.vocab_size=1000"]))
    assert "model.vocab_size=1000" in p and "set model.vocab_size=4096" in p


def test_token_id_outside_vocabulary(compose, prepared, in_work_dir, tmp_path):
    """A tokenizer larger than the model's vocabulary is caught on the prepared data."""
    from transformers import PreTrainedTokenizerFast

    tok_dir = tmp_path / "tok300"
    PreTrainedTokenizerFast(tokenizer_file=str(prepared / "tokenizer.json"),
                            eos_token="<|endoftext|>").save_pretrained(tok_dir)
    files = ",".join(CORPUS_FILES[:3])
    cfg = compose(["model=nano", "model.vocab_size=200", "data=local-text",
                   f"data.data_files=[{files}]", f"data.tokenizer={tok_dir}",
                   "data.validation_fraction=0", f"data.root={tmp_path / 'data'}",
                   "data.num_proc=1", f"runs_dir={tmp_path / 'runs'}"])
    check(cfg)  # a named tokenizer's size is only known once the data is prepared
    trainer = Trainer(cfg, tmp_path / "run")
    with pytest.raises(DataError) as e:
        trainer.setup()
    msg = str(e.value)
    assert "model.vocab_size=200" in msg and "set model.vocab_size=300" in msg
    assert not hasattr(trainer, "model")  # raised before the model was built


def test_flash_on_cpu_fails_before_data(compose, tmp_path):
    data_root, run_dir = tmp_path / "data", tmp_path / "run"
    cfg = compose(["model=nano", "model.attention=flash", f"data.root={data_root}",
                   "train.device=cpu"])
    for attempt in (lambda: Trainer(cfg, run_dir), lambda: run(cfg, run_dir)):
        with pytest.raises(AttentionBackendError) as e:
            attempt()
        assert "model.attention=flash" in str(e.value)
        assert "model.attention=sdpa" in str(e.value)
    assert not data_root.exists()
    assert not run_dir.exists()


def test_dry_run_plan_with_flash_on_cpu_is_refused(compose):
    cfg = compose(["+recipe=gpt3-125m", "model.attention=flash", "dry_run=true"])
    with pytest.raises(AttentionBackendError, match=r"model\.attention"):
        resolve_plan(cfg)
