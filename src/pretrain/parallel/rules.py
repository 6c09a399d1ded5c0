"""What makes a parallel layout valid: the one set of rules, each returning its problems.

``decision/checks.py`` reports these problems for a user's layout (each names the key and a
fix); ``planning.autolayout`` keeps only the candidate layouts they find nothing wrong
with. So a layout the search proposes always passes validation, and a rule added here
applies to both.
"""

from __future__ import annotations

import math

from pretrain.config.schema import Config, ModelConfig, ParallelConfig
from pretrain.model.gpt import ffn_dim, padded_vocab_size
from pretrain.optim.specs import OPTIMIZERS, spec
from pretrain.parallel.dp_modes import dp_mode
from pretrain.parallel.layout import (
    MULTI_STAGE_SCHEDULES,
    layout_world_size,
    model_parallel_size,
)


def world_problems(par: ParallelConfig, world_size: int) -> tuple[int | None, list[str]]:
    """(dp, problems): the data-parallel size the layout gets on ``world_size`` processes
    (None when ``parallel.dp`` itself is invalid), and why the two disagree."""
    tp, pp, mp = par.tp, par.pp, model_parallel_size(par)
    if par.dp is not None and par.dp <= 0:
        return None, [f"parallel.dp={par.dp} must be a positive integer (or null: world / "
                      "(tp*pp))"]
    if par.dp is None:
        dp = world_size // mp
        if dp > 0 and world_size % mp == 0:
            return dp, []
        return max(dp, 1), [
            f"parallel.dp=null takes dp = world size / (tp x pp), but the world size "
            f"{world_size} is not a multiple of tp={tp} x pp={pp} = {mp}; launch a "
            f"multiple of {mp} processes or set parallel.dp"]
    need = layout_world_size(par)
    if need == world_size:
        return par.dp, []
    return par.dp, [
        f"parallel layout tp={tp} x pp={pp} x dp={par.dp} needs {need} processes but the "
        f"world size is {world_size}; launch {need} (torchrun --nproc_per_node={need}, or "
        "tools/run_local.py) or change parallel.tp/pp/dp"]


def tp_problems(m: ModelConfig, tp: int, sequence_parallel: bool,
                vocab: bool = True) -> list[str]:
    """Tensor parallelism shards whole heads, KV heads, MLP units, vocabulary rows (unless
    ``vocab`` is False: to ask what else limits tp) and, with SP, sequence positions."""
    if tp == 1:
        return [] if not sequence_parallel else [
            "parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence "
            "over the tensor-parallel ranks); set parallel.tp or turn it off"]
    p, kv = [], m.n_kv_head or m.n_head
    if m.n_head % tp:
        p.append(f"model.n_head={m.n_head} is not divisible by parallel.tp={tp}: each TP "
                 f"rank holds whole heads; use a tp that divides {m.n_head}")
    if m.n_kv_head not in (None, m.n_head) and kv % tp:  # GQA; MHA is the line above
        p.append(f"model.n_kv_head={kv} is not divisible by parallel.tp={tp}: each TP rank "
                 f"holds whole key/value heads; use a tp that divides {kv} (or more KV heads)")
    rows = padded_vocab_size(m)
    if vocab and rows % tp:
        p.append(f"the vocabulary ({rows} rows) is not divisible by parallel.tp={tp} for "
                 f"the vocab-parallel embedding and head; pad it: model.pad_vocab_to="
                 f"{math.lcm(tp, 64)}")
    if ffn_dim(m) % tp:
        p.append(f"the MLP width {ffn_dim(m)} (model.d_ff) is not divisible by "
                 f"parallel.tp={tp}; choose a d_ff that is")
    if m.moe_experts:
        p.append(f"tensor parallelism (parallel.tp={tp}) does not shard a mixture of experts "
                 f"(model.moe_experts={m.moe_experts}) yet: its experts are 3-D tensors the TP "
                 "plan does not cover. Use data parallelism (zero3 shards the experts) or "
                 "pipeline parallelism, with parallel.tp=1")
    if m.qk_norm:
        p.append(f"model.qk_norm normalises each whole query/key projection, which parallel."
                 f"tp={tp} would split over ranks; use parallel.tp=1 with qk_norm")
    if sequence_parallel and m.seq_len % tp:
        p.append(f"parallel.sequence_parallel shards model.seq_len={m.seq_len} over "
                 f"parallel.tp={tp}; use a seq_len divisible by {tp}")
    return p


def batch_problems(gbs: int, mbs: int, dp: int) -> list[str]:
    """The global batch splits into whole micro batches on every DP rank."""
    if gbs > 0 and gbs % (mbs * dp):
        return [f"train.global_batch_size={gbs} is not divisible by parallel.micro_batch_size"
                f"={mbs} x dp={dp}; use a global batch that is a multiple of {mbs * dp}"]
    return []


def _schedule_problems(par: ParallelConfig) -> list[str]:
    """Stages per rank that the schedule runs: one (gpipe, 1f1b), two in a V (zbv), or
    two or more (interleaved 1f1b)."""
    vs, multi = par.virtual_stages, par.pp_schedule in MULTI_STAGE_SCHEDULES
    if par.pp_schedule == "zbv" and vs != 2:
        return [f"parallel.pp_schedule=zbv runs exactly 2 stages per rank (a V); set "
                f"parallel.virtual_stages=2 (got {vs})"]
    if multi and vs < 2:
        return [f"parallel.pp_schedule={par.pp_schedule} needs parallel.virtual_stages "
                f">= 2 stages per rank (got {vs}); or use pp_schedule=1f1b"]
    if not multi and vs != 1:
        return [f"parallel.pp_schedule={par.pp_schedule} runs one stage per rank; set "
                f"parallel.virtual_stages=1 or use pp_schedule=interleaved_1f1b"]
    return []


def pipeline_problems(cfg: Config, dp: int) -> list[str]:
    """Equal layers per stage, enough microbatches to fill the pipeline, the rounds torch's
    multi-stage schedules need, and no torch.compile under ZB-V's split backward."""
    par, n_layer, gbs = cfg.parallel, cfg.model.n_layer, cfg.train.global_batch_size
    pp, vs, mbs = par.pp, par.virtual_stages, par.micro_batch_size
    if pp == 1:
        return []
    p = _schedule_problems(par)
    if n_layer % (pp * vs):
        p.append(f"model.n_layer={n_layer} is not divisible by parallel.pp={pp} x "
                 f"parallel.virtual_stages={vs} = {pp * vs} pipeline stages; choose "
                 "pp/virtual_stages so every stage gets the same number of layers")
    micro = gbs // (mbs * dp) if gbs > 0 else 0
    rounds = max(1, micro // pp)
    if 0 < micro < pp:
        p.append(f"the pipeline gets {micro} microbatch(es) per step (global batch {gbs} / "
                 f"(micro batch {mbs} x dp {dp})) but {par.pp_schedule} needs at least "
                 f"parallel.pp={pp}; lower parallel.micro_batch_size or raise "
                 f"train.global_batch_size to {mbs * dp * pp}")
    elif par.pp_schedule in MULTI_STAGE_SCHEDULES and micro % rounds:
        p.append(f"{par.pp_schedule} needs the microbatches per step ({micro}) to be a "
                 f"multiple of {rounds} (rounds of pp={pp}); use a multiple of pp")
    if par.pp_schedule == "zbv" and cfg.train.compile:
        p.append("parallel.pp_schedule=zbv splits backward into input and weight parts, "
                 "which torch.compile does not support; set train.compile=false")
    return p


def dp_mode_problems(par: ParallelConfig, dp: int) -> list[str]:
    """HSDP (zero2/zero3): dp = dp_replicate x dp_shard."""
    rep = par.dp_replicate
    if not dp_mode(par.dp_mode).shards or dp <= 0:
        return []
    if rep <= 0 or dp % rep:
        return [f"parallel.dp_replicate={rep} must divide dp={dp} (HSDP: dp = "
                "dp_replicate x dp_shard)"]
    if par.dp_shard is not None and par.dp_shard * rep != dp:
        return [f"parallel.dp_replicate={rep} x parallel.dp_shard={par.dp_shard} must "
                f"equal dp={dp}; set dp_shard={dp // rep} (or leave it null)"]
    return []


def ep_problems(cfg: Config, dp: int) -> list[str]:
    """Expert parallelism: an MoE whose experts split evenly over ep ranks carved out of
    the FSDP shard group (torchtitan's composition, HSDP's replicas outside it); EP x TP
    (refused for any MoE by tp_problems) and EP under op-level selective checkpointing are
    not supported."""
    par, experts = cfg.parallel, cfg.model.moe_experts
    ep = par.ep
    if ep == 1:
        return []
    if ep < 1:
        return [f"parallel.ep={ep} must be a positive integer (1: no expert parallelism)"]
    if not experts:
        return [f"parallel.ep={ep} splits a mixture of experts over ranks, but the model has "
                "none (model.moe_experts=0); set parallel.ep=1 or model.moe_experts"]
    p = []
    if experts % ep:
        p.append(f"model.moe_experts={experts} is not divisible by parallel.ep={ep}: each EP "
                 f"rank holds the same number of whole experts; use an ep that divides "
                 f"{experts}")
    if not dp_mode(par.dp_mode).shards:
        p.append(f"parallel.ep={ep} runs with FSDP (parallel.dp_mode=zero3 or zero2), which "
                 "shards the experts over the data-parallel ranks outside each EP group; "
                 "set parallel.dp_mode=zero3")
    elif dp > 0 and (par.dp_shard or dp // max(par.dp_replicate, 1)) % ep:
        shard = par.dp_shard or dp // max(par.dp_replicate, 1)
        p.append(f"parallel.ep={ep} must divide the data-parallel shard group ({shard} ranks: "
                 f"dp={dp} / dp_replicate={par.dp_replicate}): the EP ranks are carved out "
                 f"of it; use a dp_shard that is a multiple of {ep}")
    if par.activation_checkpointing == "selective" and par.ac_every_n_layers == 0:
        p.append(f"parallel.ep={ep} with op-level selective checkpointing is not supported "
                 "(torch 2.13's selective checkpointing fails when the experts' FSDP hooks "
                 "run inside a recomputed block): use "
                 "parallel.activation_checkpointing=full or none, or selective with "
                 "parallel.ac_every_n_layers")
    return p


def offload_problems(cfg: Config) -> list[str]:
    """Offloading is FSDP2's (``CPUOffloadPolicy``): it needs FSDP, not DDP's replicate,
    and an optimizer whose step is elementwise (AdamW): the others reduce whole-tensor norms
    (LAMB, LARS) or gather whole matrices (Muon) over the mesh, which NCCL cannot do for
    the host-resident shards."""
    par, p = cfg.parallel, []
    if par.offload == "optimizer":
        return ["parallel.offload=optimizer: FSDP2 has no optimizer-only offload (ZeRO-Offload's "
                "optimizer state on the host); its CPUOffloadPolicy moves each rank's parameter "
                "shards to host memory, and their gradients, optimizer state and step with "
                "them: use parallel.offload=params (with parallel.dp_mode=zero2 the weights "
                "cross to the GPU once a step)"]
    if par.offload != "params":
        return p
    if not dp_mode(par.dp_mode).shards:
        p.append("parallel.offload=params moves FSDP2's parameter shards to host memory; DDP "
                 "(parallel.dp_mode=ddp) has none: set parallel.dp_mode=zero3")
    if not spec(cfg.optim.name).elementwise:
        ok = " or ".join(f"optim={n}" for n, s in OPTIMIZERS.items() if s.elementwise)
        p.append(f"parallel.offload=params runs the optimizer step on the host, where "
                 f"optim={cfg.optim.name}'s whole-tensor norms or gathers over the mesh cannot "
                 f"run (NCCL reduces GPU tensors only): use {ok} or parallel.offload=none")
    return p


def optimizer_problems(cfg: Config, world_size: int) -> list[str]:
    """An optimizer whose step does not run on DTensor parameters (its spec's
    ``on_dtensor``) on a layout that makes them: TP, or FSDP2 over more than one process."""
    par, name = cfg.parallel, cfg.optim.name
    dtensor = par.tp > 1 or (dp_mode(par.dp_mode).shards and world_size > 1)
    if spec(name).on_dtensor or not dtensor:
        return []
    return [f"optim={name}'s step does not run on DTensor parameters, which "
            f"{'TP' if par.tp > 1 else f'FSDP2 (parallel.dp_mode={par.dp_mode})'} makes: "
            f"use parallel.tp=1 and parallel.dp_mode=ddp (whole tensors on every rank), one "
            f"process, or another optimizer"]


def async_tp_problems(cfg: Config) -> list[str]:
    """Async TP is a compiler pass over the sequence-parallel collectives
    (``torch._inductor.config._micro_pipeline_tp``): without TP, SP or compile it has
    nothing to act on (torchtitan refuses it without compile too)."""
    par = cfg.parallel
    if not par.async_tp:
        return []
    need = [k for k, ok in (("parallel.tp > 1", par.tp > 1),
                            ("parallel.sequence_parallel=true", par.sequence_parallel),
                            ("train.compile=true", cfg.train.compile)) if not ok]
    return [f"parallel.async_tp=true overlaps the sequence-parallel all-gathers and "
            f"reduce-scatters with their matmuls inside compiled blocks; it needs "
            f"{' and '.join(need)}: set those, or parallel.async_tp=false"] if need else []


def layout_problems(cfg: Config, world_size: int) -> list[str]:
    """Every problem of ``cfg.parallel`` against the world size, the model shape and the
    batch ([] for a sound layout). Sizes that are not positive are left to the caller's
    own check of positive integers."""
    par = cfg.parallel
    if min(par.tp, par.pp, par.virtual_stages, par.micro_batch_size) <= 0:
        return []
    dp, p = world_problems(par, world_size)
    if dp is None:
        return p
    p += tp_problems(cfg.model, par.tp, par.sequence_parallel)
    p += batch_problems(cfg.train.global_batch_size, par.micro_batch_size, dp)
    p += pipeline_problems(cfg, dp)
    p += dp_mode_problems(par, dp)
    p += ep_problems(cfg, dp)
    p += offload_problems(cfg)
    p += optimizer_problems(cfg, world_size)
    p += async_tp_problems(cfg)
    if par.ac_every_n_layers < 0:
        p.append(f"parallel.ac_every_n_layers={par.ac_every_n_layers} must be >= 0")
    return p
