"""The plan ``tools/plan.py`` prints: memory by part, verdict, what to change, FLOPs, time and
GPU-hours to the token budget, and (for ``parallel=auto``) the ranked candidates."""

from __future__ import annotations

from dataclasses import replace

from pretrain.budget.compute import Budget, resolve_budget
from pretrain.config.schema import Config
from pretrain.data.epochs import describe_sources
from pretrain.hardware.gpus import GIB, GpuSpec
from pretrain.model.gpt import padded_vocab_size
from pretrain.parallel.activation_checkpoint import describe as describe_checkpointing
from pretrain.parallel.dp_modes import GATHER_ONCE, LEAST_MEMORY, SHARDED
from pretrain.parallel.layout import Layout, resolve_layout
from pretrain.parallel.rules import layout_problems
from pretrain.planning.autolayout import (
    evaluate,
    tp_options,
    with_parallel,
)
from pretrain.planning.cost import step_cost
from pretrain.planning.document import describe as describe_documents
from pretrain.planning.memory import PARTS, checkpoint_bytes, estimate_memory
from pretrain.planning.offload import offload_bytes, offload_seconds


def _gib(x: float) -> float:
    return round(x / GIB, 2)


def suggestions(cfg: Config, layout: Layout, gpu: GpuSpec, budget: Budget) -> list[str]:
    """Single changes to the layout that make it fit, smallest first (same GPU count where
    possible); failing those, the memory savers together (``_together``)."""
    par = replace(cfg.parallel, dp=layout.dp)  # dp may have been left to the GPU count
    tries: list[tuple[str, object]] = []
    order = ("none", "selective", "full")
    for ac in order[order.index(layout.activation_checkpointing) + 1:]:
        tries.append((f"parallel.activation_checkpointing={ac}",
                      replace(par, activation_checkpointing=ac)))
    if layout.tp > 1 and not layout.sequence_parallel:
        tries.append(("parallel.sequence_parallel=true", replace(par, sequence_parallel=True)))
    mbs = layout.micro_batch_size
    while mbs > 1:
        mbs //= 2
        tries.append((f"parallel.micro_batch_size={mbs}", replace(par, micro_batch_size=mbs)))
    n = layout.world_size
    for t in tp_options(cfg, gpu, n):
        if t > layout.tp and t % layout.tp == 0 and layout.dp % (t // layout.tp) == 0:
            tries.append((f"parallel.tp={t} parallel.sequence_parallel=true",
                          replace(par, tp=t, dp=layout.dp // (t // layout.tp),
                                  sequence_parallel=True)))
    for p in (2 * layout.pp, 4 * layout.pp):
        if cfg.model.n_layer % p == 0 and layout.dp % (p // layout.pp) == 0:
            tries.append((f"parallel.pp={p}", replace(par, pp=p, dp=layout.dp // (p // layout.pp),
                                                       virtual_stages=1, pp_schedule="1f1b")))
    if layout.dp > 1 and layout.dp_mode != LEAST_MEMORY:
        tries.append((f"parallel.dp_mode={LEAST_MEMORY}",
                      replace(par, dp_mode=LEAST_MEMORY, dp_replicate=1, dp_shard=None)))
    if layout.offload == "none":  # the weights and optimizer state in host memory; zero2
        for mode in SHARDED:  # copies them to the GPU once a step, zero3 per pass
            text = "parallel.offload=params" + (
                f" parallel.dp_mode={mode}" if mode != layout.dp_mode else "")
            tries.append((text, replace(par, offload="params", dp_mode=mode)))
    out = []
    for text, new in tries:
        if layout_problems(with_parallel(cfg, new), n):  # invalid, or another GPU count
            continue
        cand = evaluate(cfg, new, gpu, budget)
        if cand.fits:
            out.append(f"{text} -> {_gib(cand.memory.total)} GiB per GPU, "
                       f"{cand.cost.total:.4g} s/step (model)")
    return out[:4] or _together(cfg, layout, gpu, budget, par)


def _together(cfg: Config, layout: Layout, gpu: GpuSpec, budget: Budget, par) -> list[str]:
    """When no single change fits: the memory savers that keep the GPU count, added one
    after another (full recomputation, micro batch 1, then offload to host memory, zero2:
    the weights cross once a step), the first set that fits."""
    steps = []
    if layout.activation_checkpointing != "full":
        steps.append(("parallel.activation_checkpointing=full",
                      {"activation_checkpointing": "full"}))
    if layout.micro_batch_size > 1:
        steps.append(("parallel.micro_batch_size=1", {"micro_batch_size": 1}))
    if layout.offload == "none":
        steps.append((f"parallel.offload=params parallel.dp_mode={GATHER_ONCE}",
                      {"offload": "params", "dp_mode": GATHER_ONCE, "dp_replicate": 1,
                       "dp_shard": None}))
    texts, changes = [], {}
    for text, change in steps:
        texts.append(text)
        changes.update(change)
        new = replace(par, **changes)
        if layout_problems(with_parallel(cfg, new), layout.world_size):
            continue
        cand = evaluate(cfg, new, gpu, budget)
        if cand.fits:
            return [f"{' '.join(texts)} (together) -> {_gib(cand.memory.total)} GiB per GPU, "
                    f"{cand.cost.total:.4g} s/step (model)"]
    return []


def _offload_facts(cfg: Config, layout: Layout, gpu: GpuSpec, host: dict) -> dict:
    """What parallel.offload=params puts in host memory and moves each step."""
    if not host:
        return {}
    h2d, d2h = offload_bytes(cfg, layout)
    return {"host_memory_gib": {k: _gib(v) for k, v in host.items()},
            "host_memory_total_gib": _gib(sum(host.values())),
            "offload_transfer_gb": round((h2d + d2h) / 1e9, 3),
            "offload_seconds": offload_seconds(cfg, layout, gpu)}


def _vocab_note(cfg: Config) -> list[str]:
    vocab = padded_vocab_size(cfg.model)
    if vocab % 2 == 0:
        return []
    return [f"the vocabulary ({vocab} rows) is odd, so tensor parallelism is impossible; "
            "model.pad_vocab_to=128 pads it (Megatron-LM pads the same way) and allows tp "
            "up to 8"]


def _selective_note(cfg: Config, layout: Layout) -> list[str]:
    ac, sp = layout.activation_checkpointing, layout.sequence_parallel and layout.tp > 1
    if ac == "full" or (ac == "none" and not sp):
        return []
    return [describe_checkpointing(cfg.model, ac, cfg.parallel.ac_every_n_layers, sp)]


def build_plan(cfg: Config, n_gpus: int, gpu: GpuSpec, run_plan: dict,
               mfu: float | None = None) -> dict:
    """Everything the plan says, as plain data (``--json`` prints it): ``run_plan``, the
    facts the run's own plan states (resolve.describe_run), extended with memory, cost and
    time on ``gpu``."""
    layout = resolve_layout(cfg, n_gpus)
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    mem = estimate_memory(cfg, layout, gpu)
    cost = step_cost(cfg, layout, gpu, budget)
    peak = gpu.mfu_peak(cfg.precision.compute_dtype)
    mfu = mfu if mfu is not None else gpu.default_mfu
    seconds = budget.total_flops / (n_gpus * peak * mfu)
    worst = mem.worst
    return {
        **run_plan,
        "gpu": gpu.name, "gpus": n_gpus, "gpu_memory_gib": gpu.memory_gib,
        "layout_text": layout.describe(),
        "memory_gib": {k: _gib(worst.at_peak.get(k, 0.0)) for k in PARTS},
        "memory_total_gib": _gib(worst.total), "fullest_pp_rank": worst.pp_rank,
        "memory_peak_phase": worst.peak_phase,
        **_offload_facts(cfg, layout, gpu, worst.host),
        "checkpoint_gib": _gib(checkpoint_bytes(cfg)),
        "fits": mem.fits,
        "mfu": mfu, "peak_tflops": peak / 1e12,
        "time_days": seconds / 86400, "gpu_hours": n_gpus * seconds / 3600,
        "step_model": cost.as_dict(),
        "time_days_at_model_bound": budget.steps * cost.total / 86400,
        **_ramp_time(cfg, layout, gpu, budget, run_plan.get("batch_ramp")),
        "notes": list(mem.notes) + _vocab_note(cfg) + _selective_note(cfg, layout)
        + [n for n in [describe_documents(cfg, layout.micro_batch_size)] if n],
        "suggestions": [] if mem.fits else suggestions(cfg, layout, gpu, budget),
    }


def _ramp_time(cfg: Config, layout: Layout, gpu: GpuSpec, budget: Budget,
               ramp: dict | None) -> dict:
    """A ``tokens`` batch ramp's time by the cost model: each stage's steps at its own
    batch's step time (fewer micro batches: less compute a step, the same optimizer step,
    gradient reduction and pipeline fill), against the full batch's steps; {} without one
    (a ``noise_scale`` ramp's stages are only known as it runs)."""
    if not ramp or "stages" not in ramp:
        return {}
    step_s: dict[int, float] = {}
    seconds = 0.0
    for st in ramp["stages"]:
        b = st["batch"]
        if b not in step_s:
            mb = b // (layout.micro_batch_size * layout.dp)
            c = replace(cfg, train=replace(cfg.train, global_batch_size=b))
            step_s[b] = step_cost(c, replace(layout, microbatches=mb), gpu, replace(
                budget, global_batch_tokens=b * cfg.model.seq_len)).total
        seconds += st["steps"] * step_s[b]
    return {"ramp_steps": ramp["steps"], "ramp_days_at_model_bound": seconds / 86400,
            "ramp_start_step_s": step_s[ramp["stages"][0]["batch"]]}


def _verdict(p: dict) -> list[str]:
    """The verdict and, when it does not fit, what to change."""
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines = [f"verdict: {verdict} ({p['memory_total_gib']:.1f} / {p['gpu_memory_gib']:g} GiB)"]
    if p["fits"]:
        return lines
    if not p["suggestions"]:
        return [*lines, "no layout change fits on this many GPUs; try parallel=auto "
                "--gpus N with more GPUs, or a GPU with more memory"]
    together = any("(together)" in x for x in p["suggestions"])
    lines.append("to fit, make these changes together:" if together
                 else "to fit, change one of:")
    return lines + [f"  {s}" for s in p["suggestions"]]


def format_plan(p: dict) -> str:
    auto = " (auto)" if p.get("precision_auto") else ""
    active = (f", {p['n_params_active']:,} active" if p.get("n_params_active", p["n_params"])
              != p["n_params"] else "")
    lines = [f"plan: {p['model']} ({p['n_params']:,} params{active}), {p['precision']}{auto}, "
             f"{p['gpus']} x {p['gpu']} ({p['gpu_memory_gib']:g} GiB)",
             f"layout: {p['layout_text']}"]
    lines += _auto_lines(p)
    if p.get("hparam_rules"):
        from pretrain.budget.hparams import describe

        lines.append(describe(p["hparam_rules"]))
    if p.get("lr_warning"):
        lines.append(f"warning: {p['lr_warning']}")
    lines.append(f"memory per GPU (pipeline rank {p['fullest_pp_rank']}, the fullest, at its "
                 f"peak: {p['memory_peak_phase']}):")
    for k, v in p["memory_gib"].items():
        if v:
            lines.append(f"  {k:<28} {v:10.2f} GiB")
    lines.append(f"  {'total':<28} {p['memory_total_gib']:10.2f} GiB of {p['gpu_memory_gib']:g}")
    if p.get("host_memory_gib"):
        lines.append(f"host memory per GPU (parallel.offload=params): "
                     f"{p['host_memory_total_gib']:.2f} GiB ("
                     + ", ".join(f"{k} {v:.2f}" for k, v in p["host_memory_gib"].items())
                     + f"); {p['offload_transfer_gb']:,.1f} GB over PCIe and the optimizer "
                     f"step on the host: {p['offload_seconds']:.3g} s per step (model)")
    lines.append(f"one checkpoint on disk: {p['checkpoint_gib']:,.2f} GiB (weights and optimizer "
                 "state; a run checks for this much free space before it starts)")
    lines += _verdict(p)
    lines += [f"note: {n}" for n in p["notes"]]
    sm = p["step_model"]
    lines += [
        f"compute: {p['flops_per_token']:,} FLOPs/token x {p['tokens']:,} tokens = "
        f"{p['total_flops']:.3g} FLOPs ({p['steps']:,} steps); scaling-law compute "
        f"C = 6ND = {p['compute']:.3g} (tools/scaling_law.py --target-flops, budget.flops)",
        f"data: {p['data']}, " + (
            f"{p['data_tokens']:,} tokens ({p['data_tokens_from']}): the budget is "
            f"{p['epochs']:.3g} epochs" if p["epochs"] is not None
            else "size unknown until prepared (or declare data.tokens)"),
        *describe_sources(p.get("data_sources", [])),
        f"time at {p['mfu']:.0%} MFU of {p['peak_tflops']:g} TFLOP/s: {p['time_days']:.2f} days,"
        f" {p['gpu_hours']:,.0f} GPU-hours",
        f"cost model (kernels at the GPU type's calibrated efficiency, stated link and "
        f"overlap assumptions): {sm['total']:.4g} s/step, MFU {sm['mfu']:.0%} of the bf16 "
        f"peak, {p['time_days_at_model_bound']:.2f} days\n  per step: " + _cost_parts(sm),
    ]
    if sm.get("host"):
        lines.append(_host_line(sm))
    lines += _ramp_lines(p)
    return "\n".join(lines)


def _auto_lines(p: dict) -> list[str]:
    """parallel=auto's top candidates and why the first won."""
    if not p.get("parallel_auto"):
        return []
    lines = ["parallel=auto, top candidates (model step time; memory per GPU):"]
    for i, c in enumerate(p["parallel_auto"], 1):
        cst = c["cost"]
        ep = f", EP {cst['ep_comm']:.3g}" if cst.get("ep_comm") else ""
        lines.append(f"  {i}. {c['layout']}: {c['step_s']:.4g} s/step (compute "
                     f"{cst['compute'] + cst['recompute']:.4g}, TP {cst['tp_comm']:.3g}, "
                     f"bubble {cst['pp_bubble']:.3g}, p2p {cst['pp_p2p']:.3g}, DP exposed "
                     f"{cst['dp_exposed']:.3g}{ep}); {c['memory_gib']:.1f} GiB")
    return lines + [f"  why #1: {p['auto_why']}"]


def _ramp_lines(p: dict) -> list[str]:
    """The batch ramp's steps and time by the cost model, beside the full batch's."""
    if "ramp_days_at_model_bound" not in p:
        return []
    r = p["batch_ramp"]
    return [f"batch ramp (from {r['start_tokens']:,} to {r['full_tokens']:,} tokens over "
            f"{r['ramp_tokens']:,}): {p['ramp_steps']:,} steps against {p['steps']:,}, "
            f"{p['ramp_days_at_model_bound']:.2f} days by the cost model against "
            f"{p['time_days_at_model_bound']:.2f} at the full batch (first stage "
            f"{p['ramp_start_step_s']:.4g} s/step)"]


def _host_line(sm: dict) -> str:
    """The host's dispatch time against the GPU's, and which the step waits for."""
    if sm["host_bound"]:
        return (
            f"  HOST-BOUND: dispatching the step's ops takes the host {sm['host']:.3g} s, "
            f"the GPU's work {sm['device'] - sm['offload']:.3g} s: the GPU waits for launches "
            "(fewer, larger "
            "ops per step help: larger micro batches, fewer loss chunks, fused kernels)"
        )
    return f"  host dispatch {sm['host']:.3g} s per step (hidden behind the GPU's work)"


COST_PARTS = (("compute", "compute"), ("recompute", "recompute"), ("tp_comm", "TP exposed"),
              ("tp_hidden", "TP hidden by async TP"), ("pp_bubble", "pipeline bubble"),
              ("pp_p2p", "pipeline p2p"), ("dp_exposed", "DP exposed"),
              ("ep_comm", "EP all-to-all"), ("offload", "offload"))


def _cost_parts(sm: dict) -> str:
    return ", ".join(f"{name} {sm[k]:.3g} s" for k, name in COST_PARTS if sm.get(k))
