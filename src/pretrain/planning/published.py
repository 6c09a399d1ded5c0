"""Published training runs, as this planner's inputs, to check its memory and time against.

Each row is one measured configuration, read from its source (the shapes, layout, batch and
figures below are the source's):

- torchtitan's ``torchtitan/benchmarks/llama3_h100_202412_torchtitan.md`` (end of 2024): Llama 3.1
  8B, 70B and 405B on H100s with 96 GB at a 500 W limit (``h100-96gb``), sequence 8192, tokens/s
  per GPU and peak reserved memory (GiB) per row. Tables 1, 3, 4 and 5 (not the context-
  parallel tables 2 and 6: no CP here); async TP as each table states it (table 4 has the
  70B with and without, table 5's 405B runs use it). A pipelined local batch is split into
  pp microbatches, torchtitan's default then.
- Megatron-LM README, "Training Speed and Scalability" (images/model_table.png): GPT models
  with vocabulary 131,072, sequence 4096, on H100 80GB, TP x PP x DP and the global batch
  per row, per-GPU model TFLOP/s. Stated there: DP, TP and PP communication overlapped
  with compute (``--overlap-grad-reduce --overlap-param-gather``, ``--tp-comm-overlap``:
  ``parallel.async_tp`` here). Not stated, taken as Megatron-LM's usual settings: micro
  batch 1, sequence parallelism with TP, interleaved 1F1B (2 chunks a stage) when the
  layers split evenly, untied embeddings (177B = 96 x 12 x 12288^2 plus two 131,072-row
  tables), GELU MLP 4h, the distributed optimizer (ZeRO-1/2: ``zero2`` here). The
  recompute setting is not stated: no checkpointing (every row fits without it, sequence-
  parallel inputs kept as shards, as Megatron-LM keeps them).

``compare`` runs the planner on a row: predicted tokens/s per GPU (the cost model with the
GPU type's calibrated ``kernel_efficiency``; its GPU time: the host dispatch term counts this
project's ops, not those of the code that was measured), memory of the fullest rank, and whether it
fits.
``tools/plan.py --published`` prints them all; docs/benchmarks.md holds that table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TORCHTITAN = "torchtitan/benchmarks/llama3_h100_202412_torchtitan.md"
MEGATRON = "Megatron-LM README, model_table.png"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    gpus: int
    gpu: str
    overrides: tuple[str, ...]
    tokens_per_s: float | None = None  # per GPU
    tflops: float | None = None  # per GPU, model FLOPs (Megatron-LM's figure)
    memory_gib: float | None = None  # peak reserved, as published
    notes: tuple[str, ...] = field(default_factory=tuple)


def _torchtitan(name: str, model: str, gpus: int, layout: tuple[int, int, int], local: int,
                ac: str, tps: float, mem: float, compile_: bool = True, fp8: bool = True,
                schedule: str = "1f1b", async_tp: bool = False) -> PublishedRun:
    tp, pp, dp = layout
    # torchtitan (9dec370) splits a pipelined local batch into pp microbatches by default
    # (experimental.pipeline_parallel_microbatches unset: parallelisms/pipelining_utils.py)
    ov = [f"model={model}", "precision=" + ("fp8" if fp8 else "bf16"), f"parallel.tp={tp}",
          f"parallel.pp={pp}", f"parallel.dp={dp}", "parallel.dp_mode=zero3",
          f"parallel.sequence_parallel={str(tp > 1).lower()}",
          f"parallel.async_tp={str(async_tp).lower()}",
          f"parallel.micro_batch_size={local // pp}",
          f"parallel.activation_checkpointing={ac}", f"train.global_batch_size={local * dp}",
          f"train.compile={str(compile_).lower()}", f"parallel.pp_schedule={schedule}"]
    if schedule == "interleaved_1f1b":
        ov.append("parallel.virtual_stages=2")
    return PublishedRun(name, TORCHTITAN, gpus, "h100-96gb", tuple(ov), tokens_per_s=tps,
                        memory_gib=mem)


def _megatron(size: str, heads: int, hidden: int, layers: int, layout: tuple[int, int, int],
              batch: int, tflops: float) -> PublishedRun:
    tp, pp, dp = layout
    v = 2 if pp > 1 and (layers // pp) % 2 == 0 else 1
    ov = [f"model.n_layer={layers}", f"model.n_head={heads}", f"model.d_model={hidden}",
          "model.seq_len=4096", "model.vocab_size=131072", "model.pad_vocab_to=128",
          "model.tie_embeddings=false", "model.bias=false", "model.pos_emb=rope",
          "precision=bf16", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
          "parallel.dp_mode=zero2", f"parallel.sequence_parallel={str(tp > 1).lower()}",
          f"parallel.async_tp={str(tp > 1).lower()}", "parallel.micro_batch_size=1",
          f"parallel.pp_schedule={'interleaved_1f1b' if v > 1 else '1f1b'}",
          f"parallel.virtual_stages={v}", "parallel.activation_checkpointing=none",
          f"train.global_batch_size={batch}", "train.compile=true"]
    return PublishedRun(f"Megatron-LM GPT {size}", MEGATRON, tp * pp * dp, "h100-80gb",
                        tuple(ov), tflops=tflops)


RUNS: tuple[PublishedRun, ...] = (
    _torchtitan("torchtitan 8B FSDP 8", "llama3-8b", 8, (1, 1, 8), 2, "selective", 5762,
                82.4, compile_=False, fp8=False),
    _torchtitan("torchtitan 8B FSDP 8 + compile", "llama3-8b", 8, (1, 1, 8), 2, "selective",
                6667, 77.0, fp8=False),
    _torchtitan("torchtitan 8B FSDP 8 + compile + fp8", "llama3-8b", 8, (1, 1, 8), 2,
                "selective", 8532, 76.8),
    _torchtitan("torchtitan 8B FSDP 128", "llama3-8b", 128, (1, 1, 128), 2, "selective", 5605,
                67.0, compile_=False, fp8=False),
    _torchtitan("torchtitan 8B FSDP 128 + compile", "llama3-8b", 128, (1, 1, 128), 2,
                "selective", 6514, 62.0, fp8=False),
    _torchtitan("torchtitan 8B FSDP 128 + compile + fp8", "llama3-8b", 128, (1, 1, 128), 2,
                "selective", 8380, 61.8),
    _torchtitan("torchtitan 70B FSDP 32 x TP 8", "llama3-70b", 256, (8, 1, 32), 16, "full",
                829, 71.9),
    _torchtitan("torchtitan 70B FSDP 32 x TP 8 + async TP", "llama3-70b", 256, (8, 1, 32), 16,
                "full", 876, 67.6, async_tp=True),
    _torchtitan("torchtitan 405B FSDP 8 x TP 8 x PP 8, 1F1B", "llama3-405b", 512, (8, 8, 8),
                32, "full", 100, 82.5, async_tp=True),
    _torchtitan("torchtitan 405B FSDP 8 x TP 8 x PP 8, interleaved", "llama3-405b", 512,
                (8, 8, 8), 32, "full", 128, 72.7, schedule="interleaved_1f1b", async_tp=True),
    _megatron("1.7B", 16, 2048, 24, (1, 1, 48), 192, 408.8),
    _megatron("7.1B", 32, 4096, 30, (2, 1, 48), 192, 465.9),
    _megatron("16B", 48, 6144, 32, (4, 1, 48), 192, 489.1),
    _megatron("32B", 56, 7168, 48, (8, 1, 48), 192, 459.6),
    _megatron("70B", 64, 8192, 84, (8, 2, 48), 384, 419.7),
    _megatron("119B", 80, 10240, 92, (8, 4, 48), 768, 420.5),
    _megatron("177B", 96, 12288, 96, (8, 6, 48), 1152, 432.8),
    _megatron("314B", 128, 16384, 96, (8, 8, 48), 1536, 474.4),
    _megatron("462B", 144, 18432, 112, (8, 16, 48), 3072, 459.9),
)


def compare(run: PublishedRun) -> dict:
    """The planner on one published run: its figures next to the published ones."""
    from pretrain.budget.compute import resolve_budget
    from pretrain.config.compose import compose_config
    from pretrain.hardware.gpus import get_gpu
    from pretrain.parallel.layout import resolve_layout
    from pretrain.planning.cost import step_cost
    from pretrain.planning.memory import estimate_memory

    cfg = compose_config([*run.overrides, "precision.fp8_allow_emulation=true"])
    layout, gpu = resolve_layout(cfg, run.gpus), get_gpu(run.gpu)
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    cost, mem = step_cost(cfg, layout, gpu, budget), estimate_memory(cfg, layout, gpu)
    published = run.tokens_per_s or run.tflops * 1e12 / budget.flops_per_token
    # the GPU's time: the host's (cost.host) is this project's dispatch, not the source's
    predicted = budget.global_batch_tokens / cost.device / run.gpus
    return {"name": run.name, "source": run.source, "gpu": gpu.name, "gpus": run.gpus,
            "layout": layout.describe(), "published_tps": published,
            "predicted_tps": predicted, "ratio": predicted / published,
            # what the ratio would be if every transfer and bubble were hidden: the
            # kernels alone at the calibrated efficiency
            "compute_bound_ratio": budget.global_batch_tokens / (
                cost.compute + cost.recompute) / run.gpus / published,
            "published_mfu": published * budget.flops_per_token / gpu.mfu_peak("bfloat16"),
            "predicted_gib": mem.total / 2**30, "published_gib": run.memory_gib,
            "fits": mem.fits, "capacity_gib": gpu.memory_gib}


def markdown(rows: list[dict]) -> str:
    lines = ["| run | GPUs | tokens/s/GPU published | predicted | ratio | ratio, kernels "
             "only | memory GiB published | predicted | fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pub_mem = f"{r['published_gib']:.1f}" if r["published_gib"] else "n/a"
        lines.append(
            f"| {r['name']} | {r['gpus']} x {r['gpu']} | {r['published_tps']:,.0f} | "
            f"{r['predicted_tps']:,.0f} | {r['ratio']:.2f} | {r['compute_bound_ratio']:.2f} | "
            f"{pub_mem} | "
            f"{r['predicted_gib']:.1f} | {'yes' if r['fits'] else 'NO'} |")
    return "\n".join(lines)
