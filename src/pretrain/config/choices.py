"""The closed sets of values config keys take (``Choice`` enums): the one list of each,
which the schema (schema.py) types its keys with and every user reads."""

from __future__ import annotations

from enum import StrEnum


class Choice(StrEnum):
    """The values a config key can take: the one list of them, which every user reads.

    OmegaConf turns a YAML or command-line string into a member by its *name* and refuses
    any other string at composition, naming the key and the allowed values; so every
    member's name is its value. A member is the ``str`` it names: code compares it with
    ``"rope"``, looks it up in dicts keyed by strings, and JSON writes it as that string.
    """

    def __repr__(self) -> str:  # messages and reprs show 'rope', as for a plain string
        return repr(self.value)


def _choice(name: str, values: str) -> type[Choice]:
    """The Choice enum ``name`` of these space-separated values, each member named by its
    value (the functional API: "1f1b" is no Python identifier)."""
    return Choice(name, [(v, v) for v in values.split()], module=__name__, qualname=name)


PosEmb = _choice("PosEmb", "learned rope")
Norm = _choice("Norm", "layernorm rmsnorm")
Mlp = _choice("Mlp", "gelu swiglu")
# flex: FlexAttention (CUDA), for attention_mask=document
AttentionBackend = _choice("AttentionBackend", "auto flash sdpa eager flex")
AttentionMask = _choice("AttentionMask", "causal document")
Dtype = _choice("Dtype", "float32 bfloat16 float16")
# Master weights and optimizer state are always float32: pure low-precision weights are not
# supported; a lower precision is precision.compute_dtype's.
MasterDtype = _choice("MasterDtype", "float32")
Fp8Recipe = _choice("Fp8Recipe", "tensorwise rowwise")  # torchao's recipe names
Fp8Filter = _choice("Fp8Filter", "auto all")
DpMode = _choice("DpMode", "ddp zero2 zero3")
# optimizer: refused with the way out (FSDP2 has no optimizer-only offload: rules.py)
Offload = _choice("Offload", "none params optimizer")
PipelineSchedule = _choice("PipelineSchedule", "gpipe 1f1b interleaved_1f1b zbv")
ActivationCheckpointing = _choice("ActivationCheckpointing", "none selective full")
LrScaling = _choice("LrScaling", "none sqrt linear")
NsDtype = _choice("NsDtype", "bfloat16 float32")  # optim.muon_ns_dtype
HparamRule = _choice("HparamRule", "fixed deepseek power")  # optim.lr_rule, train.batch_rule
Decay = _choice("Decay", "cosine linear wsd constant")
# The shape of WSD's decay: linear, or 1-sqrt (Hägele et al. 2024: lr = peak (1 - sqrt(x)),
# x the fraction of the decay done; it beats linear at the same length).
DecayShape = _choice("DecayShape", "linear 1-sqrt")
BudgetKind = _choice("BudgetKind", "tokens tokens_per_param flops steps")
ParamCount = _choice("ParamCount", "total non_embedding")
WandbMode = _choice("WandbMode", "disabled offline online")
Device = _choice("Device", "auto cpu cuda")
# Mixture-of-experts load balancing: the Switch/GShard auxiliary loss, DeepSeek-V3's
# auxiliary-loss-free bias, or none.
MoeBalance = _choice("MoeBalance", "aux_loss aux_free none")
# model.parametrization: standard, muP (Yang et al. 2022), CompleteP (Dey et al. 2025); the
# rules are pretrain/model/parametrization.py's.
Parametrization = _choice("Parametrization", "sp mup completep")

# batch_ramp (conf/batch_ramp/): none, tokens (a fixed ramp over tokens), noise_scale (grows
# with the measured gradient noise scale)
RampKind = _choice("RampKind", "none tokens noise_scale")
# How the LR follows the batch during a ramp: auto is the optimizer's own rule
# (OptimizerSpec.ramp_lr: sqrt for the Adam family, LAMB and Muon; linear for SGD and LARS)
RampLr = _choice("RampLr", "auto none sqrt linear")
