"""A key's allowed values live in one place, its Choice enum in pretrain.config.choices: a value
outside it is refused at composition naming the key and the values, every user of the key
handles exactly those values, and every output writes them as plain strings."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest
from helpers import REPO
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from pretrain.budget.compute import rule_tokens
from pretrain.config import choices
from pretrain.config.schema import (
    AttentionBackend,
    BudgetConfig,
    BudgetKind,
    Choice,
    Config,
    Decay,
    DecayShape,
    Dtype,
    Fp8Recipe,
    LrScaling,
    MasterDtype,
    ModelConfig,
    NsDtype,
    OptimConfig,
    PipelineSchedule,
    ScheduleConfig,
)
from pretrain.model.attention import KERNELS
from pretrain.optim.factory import lr_multiplier, scaled_lr
from pretrain.optim.muon import NS_DTYPES
from pretrain.parallel.pipeline import SCHEDULE_CLASSES
from pretrain.planning.activations import inflight_chunks
from pretrain.precision.policy import DTYPES

# Every key with a closed set of values, a value outside it, and the values the refusal
# must list.
BAD_CHOICES = [
    ("model.pos_emb", "alibi", "learned, rope"),
    ("model.norm", "batchnorm", "layernorm, rmsnorm"),
    ("model.mlp", "relu", "gelu, swiglu"),
    ("model.moe_balance", "expert_choice", "aux_loss, aux_free, none"),
    ("model.parametrization", "ntk", "sp, mup, completep"),
    ("model.attention", "xformers", "auto, flash, sdpa, eager, flex"),
    ("model.attention_mask", "sliding", "causal, document"),
    ("precision.param_dtype", "bfloat16", "float32"),
    ("precision.compute_dtype", "float8", "float32, bfloat16, float16"),
    ("precision.reduce_dtype", "fp32", "float32, bfloat16, float16"),
    ("precision.fp8_recipe", "delayed", "tensorwise, rowwise"),
    ("precision.fp8_filter", "none", "auto, all"),
    ("parallel.dp_mode", "zero1", "ddp, zero2, zero3"),
    ("parallel.offload", "disk", "none, params, optimizer"),
    ("parallel.pp_schedule", "dualpipe", "gpipe, 1f1b, interleaved_1f1b, zbv"),
    ("parallel.activation_checkpointing", "half", "none, selective, full"),
    ("optim.lr_scaling", "cube", "none, sqrt, linear"),
    ("optim.lr_rule", "kaplan", "fixed, deepseek, power"),
    ("optim.muon_ns_dtype", "float16", "bfloat16, float32"),
    ("schedule.decay", "exponential", "cosine, linear, wsd, constant"),
    ("schedule.decay_shape", "sqrt", "linear, 1-sqrt"),
    ("budget.kind", "epochs", "tokens, tokens_per_param, flops, steps"),
    ("budget.param_count", "all", "total, non_embedding"),
    ("batch_ramp.name", "exponential", "none, tokens, noise_scale"),
    ("batch_ramp.lr_scaling", "cube", "auto, none, sqrt, linear"),
    ("logging.wandb", "on", "disabled, offline, online"),
    ("train.batch_rule", "kaplan", "fixed, deepseek, power"),
    ("train.device", "tpu", "auto, cpu, cuda"),
]


def choice_keys() -> dict[str, type[Choice]]:
    """``section.key`` -> its Choice enum, for every such key of the schema."""
    out = {}
    for section in dataclasses.fields(Config):
        schema = section.default_factory
        if not dataclasses.is_dataclass(schema):
            continue
        for name, hint in typing.get_type_hints(schema).items():
            if isinstance(hint, type) and issubclass(hint, Choice):
                out[f"{section.name}.{name}"] = hint
    return out


@pytest.mark.parametrize("key,value,allowed", BAD_CHOICES)
def test_bad_choice_is_refused_at_composition(compose, key, value, allowed):
    """Refused before Hydra composes (config/naming.check_override_values), in one line
    naming the key and its options; still a ConfigCompositionException, as Hydra's is."""
    with pytest.raises(ConfigCompositionException) as e:
        compose(["+recipe=tiny", f"{key}={value}"])
    assert e.value.lines() == [f"{key}={value}: '{value}' is not a value of {key}; the "
                               f"options: {allowed}"]


def test_every_choice_key_is_tested():
    assert {key for key, _, _ in BAD_CHOICES} == set(choice_keys())


def test_train_py_refuses_a_bad_choice_naming_key_and_values():
    proc = subprocess.run([sys.executable, "train.py", "model.norm=batchnorm", "dry_run=true"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "error: model.norm=batchnorm: 'batchnorm' is not a value of model.norm; the options: "
        "layernorm, rmsnorm"]


def test_member_names_are_their_values():
    """OmegaConf converts a string to a member by name: a name that differed from its value
    would make the value unreachable from YAML."""
    enums = [e for e in vars(choices).values()
             if isinstance(e, type) and issubclass(e, Choice) and e is not Choice]
    assert set(choice_keys().values()) == set(enums)  # no enum without a key
    for enum in enums:
        assert [m.name for m in enum] == [m.value for m in enum], enum
        for member in enum:
            assert member == member.value and hash(member) == hash(member.value)
            assert json.dumps(member) == f'"{member.value}"' and repr(member) == repr(member.value)
    assert PipelineSchedule["1f1b"] == "1f1b"


def test_every_user_handles_exactly_the_choices():
    assert set(SCHEDULE_CLASSES) == set(PipelineSchedule)
    assert set(DTYPES) == set(Dtype) >= set(MasterDtype)
    assert set(NS_DTYPES) == set(NsDtype)  # optim.muon_ns_dtype -> the torch dtype
    assert set(KERNELS) == set(AttentionBackend) - {"auto"}
    for schedule in PipelineSchedule:  # raises for a schedule it does not know
        assert inflight_chunks(schedule, pp=4, v=2, microbatches=8, pp_rank=0) >= 1
    torchao_config = pytest.importorskip("torchao.float8.config")
    names = {r.value for r in torchao_config.Float8LinearRecipeName}
    assert set(Fp8Recipe) <= names  # precision.fp8_recipe: torchao's recipe names


def test_every_decay_scaling_and_budget_kind_is_its_own():
    """The code branches on these keys' values with the last value as the fall-through: a
    value added without its branch would act as the last one, and collide here."""
    curves = {tuple(round(lr_multiplier(s, 100, 10, ScheduleConfig(decay=d)), 9)
                    for s in range(100)) for d in Decay}
    assert len(curves) == len(Decay)
    shapes = {tuple(lr_multiplier(s, 100, 10, ScheduleConfig(decay="wsd", decay_shape=d))
                    for s in range(100)) for d in DecayShape}
    assert len(shapes) == len(DecayShape)
    lrs = {scaled_lr(OptimConfig(lr=1.0, lr_scaling=s, ref_batch_tokens=1000), 4000)
           for s in LrScaling}
    assert lrs == {1.0, 2.0, 4.0}
    budget = dict(tokens=10**6, tokens_per_param=2.0, flops=1e15, steps=5)
    rules = {rule_tokens(ModelConfig(), BudgetConfig(kind=k, **budget), 8)[1] for k in BudgetKind}
    assert len(rules) == len(BudgetKind)


def test_outputs_write_choices_as_plain_strings(compose):
    cfg = compose(["+recipe=gpt3-175b"])
    assert cfg.parallel.pp_schedule is PipelineSchedule.interleaved_1f1b
    # the run's config for wandb and checkpoint meta.json (a JSON round trip), Hydra's
    # .hydra/config.yaml, and reprs in messages
    container = OmegaConf.to_container(OmegaConf.structured(cfg))
    text = json.dumps(container)
    assert '"pp_schedule": "interleaved_1f1b"' in text and '"wandb": "offline"' in text
    assert json.loads(text) == container
    assert "  pp_schedule: interleaved_1f1b\n" in OmegaConf.to_yaml(OmegaConf.structured(cfg))
    assert "pos_emb='learned'" in repr(cfg.model)
    # tools/export_hf.py rebuilds the config from meta.json's plain strings
    back = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), json.loads(text)))
    assert back == cfg and back.parallel.pp_schedule is PipelineSchedule.interleaved_1f1b
