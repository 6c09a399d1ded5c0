"""The planner's memory against the simulation on a matrix of layouts
(``tools/plan.py --check-matrix``): for each row, one rank of a published preset's layout
started on this CPU (``simulate.simulate``: fake process group, fake tensors, torch's
MemTracker), its forward/backward peak next to the planner's (``memory.rank_memory``'s
largest phase), by MemTracker's kinds (``phases.KIND_OF``).

The presets keep their real widths (hidden size, heads, FFN, vocabulary, experts) and run
fewer layers, so the whole matrix takes minutes on a 2-core CPU; a layer's memory is the
same, and the parts that scale with the layers scale in both. One row runs a whole model:
torchtitan's Llama 3 8B row (planning/published.py), rank 0.

What the simulation cannot model on the CPU is said on its row: ``parallel.offload=params``
pins host copies (FSDP2's ``CPUOffloadPolicy``); here only what stays on the GPU is
compared (the offloaded parts are on the host in both).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config.compose import compose_config
from pretrain.parallel.layout import layout_world_size
from pretrain.planning.phases import COMPARED, KINDS

# planned / simulated peak in [0.95, 1.05]; each kind (phases.COMPARED) within 5% of the peak
TOLERANCE = 0.05

_13B = ["+recipe=gpt3-1.3b", "precision=bf16", "train.compile=false", "model.n_layer=4"]
_67B = ["+recipe=gpt3-6.7b", "precision=bf16", "train.compile=false", "model.n_layer=4",
        "model.seq_len=2048"]
_MOE = ["+recipe=mixtral-8x7b", "precision=bf16", "train.compile=false", "model.n_layer=2",
        "parallel.activation_checkpointing=none"]
_Z3 = ["parallel=zero3", "parallel.dp=8", "parallel.micro_batch_size=2"]


@dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]
    rank: int = 1
    fast: bool = False  # in the test's few rows
    note: str = ""


ROWS = (
    Row("1.3B zero3, one micro batch", (*_13B, *_Z3, "train.global_batch_size=16"), fast=True),
    Row("1.3B zero3, 2 micro batches", (*_13B, *_Z3, "train.global_batch_size=32")),
    Row("1.3B zero2, one micro batch", (*_13B, *_Z3, "parallel.dp_mode=zero2",
                                        "train.global_batch_size=16")),
    Row("1.3B zero2, 2 micro batches (no-sync)", (*_13B, *_Z3, "parallel.dp_mode=zero2",
                                                  "train.global_batch_size=32"), fast=True),
    Row("1.3B ddp (no ZeRO-1 here), 2 micro batches", (
        *_13B, *_Z3, "parallel.dp_mode=ddp", "train.global_batch_size=32")),
    Row("1.3B HSDP 2 x 4", (*_13B, *_Z3, "parallel.dp_replicate=2", "parallel.dp_shard=4",
                            "train.global_batch_size=16"), rank=5),
    Row("1.3B one device, accumulation", (*_13B, "parallel=single",
                                          "parallel.micro_batch_size=2",
                                          "train.global_batch_size=4"), rank=0),
    Row("1.3B one device, CUDA graphs", (*_13B, "parallel=single", "parallel.micro_batch_size=2",
                                         "train.global_batch_size=2", "train.cuda_graphs=true"),
        rank=0, note="graphs keep .grad between steps"),
    Row("1.3B fp8 zero3", ("+recipe=gpt3-1.3b", "precision=fp8", "train.compile=false",
                           "model.n_layer=4", *_Z3, "train.global_batch_size=16")),
    Row("1.3B offload zero2", (*_13B, "parallel=zero2", "parallel.dp=2",
                               "parallel.micro_batch_size=2", "parallel.offload=params",
                               "train.global_batch_size=4"),
        note="pinned host copies not simulated: GPU-resident parts only"),
    Row("6.7B tp4 SP zero3", (*_67B, "parallel=zero3", "parallel.tp=4",
                              "parallel.sequence_parallel=true", "parallel.dp=2",
                              "parallel.micro_batch_size=1", "train.global_batch_size=2",
                              "parallel.activation_checkpointing=none"), rank=5, fast=True),
    Row("6.7B tp2 SP, selective", (*_67B, "parallel=zero3", "parallel.tp=2",
                                   "parallel.sequence_parallel=true", "parallel.dp=4",
                                   "parallel.micro_batch_size=1", "train.global_batch_size=4",
                                   "parallel.activation_checkpointing=selective"), rank=3),
    Row("6.7B zero3, full recompute", (*_67B, "parallel=zero3", "parallel.dp=8",
                                       "parallel.micro_batch_size=2",
                                       "train.global_batch_size=16",
                                       "parallel.activation_checkpointing=full")),
    Row("6.7B zero3, selective every 2nd full", (
        *_67B, "parallel=zero3", "parallel.dp=8", "parallel.micro_batch_size=1",
        "train.global_batch_size=8", "parallel.activation_checkpointing=selective",
        "parallel.ac_every_n_layers=2")),
    Row("6.7B pp2 1F1B", (*_67B, "parallel=zero3", "parallel.pp=2", "parallel.dp=2",
                          "parallel.micro_batch_size=1", "train.global_batch_size=8",
                          "parallel.pp_schedule=1f1b"), rank=0, fast=True),
    Row("6.7B pp2 interleaved x2", (*_67B, "parallel=zero3", "parallel.pp=2", "parallel.dp=2",
                                    "parallel.micro_batch_size=1", "train.global_batch_size=8",
                                    "parallel.pp_schedule=interleaved_1f1b",
                                    "parallel.virtual_stages=2"), rank=0, fast=True),
    Row("6.7B pp2 zero-bubble (ZBV)", (*_67B, "parallel=zero3", "parallel.pp=2",
                                       "parallel.dp=2", "parallel.micro_batch_size=1",
                                       "train.global_batch_size=8", "parallel.pp_schedule=zbv",
                                       "parallel.virtual_stages=2"), rank=0),
    Row("Llama 3 8B zero3 selective (torchtitan's row, all 32 layers)", (
        "model=llama3-8b", "precision=bf16", "parallel.dp=8", "parallel.dp_mode=zero3",
        "parallel.micro_batch_size=2", "parallel.activation_checkpointing=selective",
        "train.global_batch_size=16", "train.compile=false"), rank=0),
    Row("Mixtral EP4 zero3", (*_MOE, "parallel=zero3", "parallel.dp=8", "parallel.ep=4",
                              "parallel.micro_batch_size=1", "train.global_batch_size=8",
                              "model.seq_len=1024")),
)


def run_row(row: Row) -> dict:
    """Simulate ``row``'s rank (its step only: no real initialisation) and compare."""
    from pretrain.planning.simulate import simulate

    cfg = compose_config(list(row.overrides))
    n = layout_world_size(cfg.parallel)
    r = simulate(cfg, n, row.rank, step=True, initialise=False)
    pred = r["predicted"]
    # offload: the simulation holds the host's parts on this CPU too; the GPU's are compared
    measured = {k: r["step_peak_by_kind"].get(k, 0) - pred["host_by_kind"][k] for k in KINDS}
    planned = pred["step_peak_by_kind"]
    peak = sum(measured.values())
    ratio = pred["step_peak_bytes"] / peak
    worst_kind = max(abs(sum(planned[k] - measured[k] for k in group))
                     for group in COMPARED) / peak
    return {"row": row.name, "layout": r["layout"], "rank": row.rank,
            "phase": pred["step_peak_phase"], "simulated": peak,
            "planned": pred["step_peak_bytes"], "ratio": round(ratio, 3),
            "measured_by_kind": measured, "planned_by_kind": planned,
            "worst_kind_share": round(worst_kind, 3), "note": row.note,
            "ok": abs(ratio - 1) <= TOLERANCE and worst_kind <= TOLERANCE,
            "seconds": r["seconds"]}


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def markdown(results: list[dict]) -> str:
    """The matrix as a markdown table: peaks in GB, kinds as simulated / planned."""
    head = ("| layout (rank) | phase | simulated GB | planned GB | planned/sim | "
            + " | ".join(f"{k} sim/plan" for k in KINDS) + " | ok | note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        kinds = " | ".join(f"{_gb(r['measured_by_kind'][k])} / {_gb(r['planned_by_kind'][k])}"
                           for k in KINDS)
        lines.append(f"| {r['row']}: {r['layout']} ({r['rank']}) | {r['phase']} | "
                     f"{_gb(r['simulated'])} | {_gb(r['planned'])} | {r['ratio']:.3f} | "
                     f"{kinds} | {'yes' if r['ok'] else 'NO'} | {r['note']} |")
    return "\n".join(lines)


def check_matrix(fast_only: bool = False, progress=None) -> tuple[list[dict], str]:
    """Every row (``fast_only``: the test's few), each passed to ``progress`` when done."""
    results = []
    for row in ROWS:
        if row.fast or not fast_only:
            results.append(run_row(row))
            if progress is not None:
                progress(results[-1])
    return results, markdown(results)
