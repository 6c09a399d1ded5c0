"""``parallel=auto``: choose tp, pp, dp, dp mode, micro batch, activation checkpointing and
pipeline schedule for a GPU count and type.

The search enumerates every layout the validator accepts (it filters with the same rules,
``parallel.rules``: tp divides the heads, the KV heads, the MLP width and the vocabulary;
pp x virtual stages divides the layers; dp = n / (tp pp) divides the global batch;
pipelines get at least pp microbatches), with tp at most a node's GPUs and sequence
parallelism whenever tp > 1 (same traffic, less memory). For each it tries
checkpointing none -> selective -> full and keeps the first that fits in memory (more
recomputation never makes a step faster), drops layouts that fit under none of them, and
ranks the rest by the step time of ``cost.step_cost``; ties go to a micro batch of at least
8192 tokens (taller GEMMs run closer to peak, which the cost model does not count), then to
the layout with the most memory headroom.

A layout "fits" here only with ``HEADROOM`` of the GPU's memory left over: the planner's
estimate is within about 15% of the published peaks it was checked against (torchtitan's
Llama 3.1 8B reserved 82.4 GiB where it predicts 71.1; docs/benchmarks.md), and a rank at
98% of memory fails on the first allocator spike. ``tools/plan.py`` on a layout you chose
still reports whether it fits at all.

``parallel=auto`` is resolved before validation (resolve.py, the one decision path): the
config gets ``parallel`` replaced by ``choose_layout``'s winner, which
decision/checks.py's ``check`` then checks like any layout.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

from pretrain.budget.compute import Budget, resolve_budget
from pretrain.config.schema import Config, ParallelConfig
from pretrain.errors import UserError
from pretrain.hardware.gpus import GpuSpec, get_gpu
from pretrain.model.gpt import padded_vocab_size
from pretrain.parallel.dp_modes import DP_MODES, LEAST_MEMORY, SHARDED
from pretrain.parallel.layout import Layout, layout_world_size, resolve_layout
from pretrain.parallel.rules import layout_problems, tp_problems
from pretrain.planning.cost import StepCost, step_cost
from pretrain.planning.memory import MemoryEstimate, estimate_memory

MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (2, 3, 4)
CHECKPOINTING = ("none", "selective", "full")
MAX_GPUS = 16384
HEADROOM = 0.10  # the share of each GPU's memory a chosen layout leaves free


class LayoutError(UserError, ValueError):
    """No layout exists (impossible GPU count) or none fits in memory."""


@dataclass
class Candidate:
    parallel: ParallelConfig
    layout: Layout
    memory: MemoryEstimate
    cost: StepCost
    seq_len: int

    @property
    def fits(self) -> bool:
        return self.memory.fits_within(1 - HEADROOM)

    def describe(self) -> str:
        return self.layout.describe()

    def summary(self) -> dict:
        return {"layout": self.describe(), "parallel": self.parallel.__dict__,
                "memory_gib": self.memory.total / 2**30, "fits": self.fits,
                "step_s": self.cost.total, "cost": self.cost.as_dict()}


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_options(cfg: Config, gpu: GpuSpec, n_gpus: int, vocab_ok: bool = True) -> list[int]:
    """Tensor-parallel sizes of ``n_gpus`` within a node that the layout rules accept with
    sequence parallelism on (``vocab_ok=False``: ignoring the vocabulary's divisibility)."""
    return [t for t in divisors(n_gpus) if t <= gpu.gpus_per_node
            and not tp_problems(cfg.model, t, sequence_parallel=t > 1, vocab=vocab_ok)]


def _schedules(pp: int) -> list[tuple[str, int]]:
    """Schedules and stages per rank to try; the layout rules drop what the layers or
    microbatches do not allow."""
    if pp == 1:
        return [("1f1b", 1)]
    return ([("1f1b", 1), ("gpipe", 1)]
            + [("interleaved_1f1b", v) for v in VIRTUAL_STAGES] + [("zbv", 2)])


def _dp_modes(dp: int, tp: int, gpu: GpuSpec) -> list[tuple[str, int, int | None]]:
    """(dp_mode, dp_replicate, dp_shard) options; HSDP shards within a node."""
    if dp == 1:
        return [(LEAST_MEMORY, 1, None)]
    out: list[tuple[str, int, int | None]] = [(mode, 1, None) for mode in DP_MODES]
    in_node = max((s for s in divisors(dp) if s * tp <= gpu.gpus_per_node), default=1)
    if 1 < in_node < dp:
        out += [(mode, dp // in_node, in_node) for mode in SHARDED]
    return out


def _shapes(cfg: Config, n_gpus: int, gpu: GpuSpec) -> Iterator[tuple[int, int, int]]:
    """(tp, pp, dp) with tp * pp * dp = n_gpus, tp within a node and valid for the model."""
    for tp in tp_options(cfg, gpu, n_gpus):
        for pp in divisors(n_gpus // tp):
            yield tp, pp, n_gpus // (tp * pp)


def _whole_rounds(parallel: ParallelConfig, gbs: int) -> bool:
    """The search's own restriction, beyond validity: multi-stage schedules only with
    microbatches in whole rounds of pp (torch accepts any count that splits into equal
    rounds; the in-flight counts of planning/activations.py assume whole rounds)."""
    micro = gbs // (parallel.micro_batch_size * parallel.dp)
    return parallel.virtual_stages == 1 or micro % parallel.pp == 0


def enumerate_parallel(cfg: Config, n_gpus: int, gpu: GpuSpec) -> Iterator[ParallelConfig]:
    """Every layout of ``n_gpus`` the layout rules (``parallel.rules``, which validation
    applies) accept, checkpointing left at none."""
    gbs = cfg.train.global_batch_size
    for (tp, pp, dp), mbs in itertools.product(_shapes(cfg, n_gpus, gpu), MICRO_BATCHES):
        for (schedule, v), (mode, rep, shard), ep in itertools.product(
                _schedules(pp), _dp_modes(dp, tp, gpu), _ep_options(cfg, dp, tp, gpu)):
            par = ParallelConfig(
                name="auto", tp=tp, pp=pp, dp=dp, dp_mode=mode, dp_replicate=rep,
                dp_shard=shard, ep=ep, pp_schedule=schedule, virtual_stages=v,
                micro_batch_size=mbs, sequence_parallel=tp > 1,
                async_tp=cfg.parallel.async_tp and tp > 1, activation_checkpointing="none")
            if _whole_rounds(par, gbs) and not layout_problems(with_parallel(cfg, par), n_gpus):
                yield par


def _ep_options(cfg: Config, dp: int, tp: int, gpu: GpuSpec) -> list[int]:
    """Expert-parallel degrees to try: 1, and for a mixture of experts every divisor of
    the expert count that divides dp with the EP group (times TP) inside a node, where the
    all-to-all runs over NVLink (torchtitan and Megatron-LM keep EP in a node too)."""
    experts = cfg.model.moe_experts
    return [1] + [e for e in divisors(experts) if e > 1 and dp % e == 0
                  and e * tp <= gpu.gpus_per_node] if experts else [1]


def with_parallel(cfg: Config, parallel: ParallelConfig) -> Config:
    out = copy.copy(cfg)
    out.parallel = parallel
    return out


def evaluate(cfg: Config, parallel: ParallelConfig, gpu: GpuSpec, budget: Budget) -> Candidate:
    c = with_parallel(cfg, parallel)
    layout = resolve_layout(c, layout_world_size(parallel))
    return Candidate(parallel, layout, estimate_memory(c, layout, gpu),
                     step_cost(c, layout, gpu, budget), cfg.model.seq_len)


EFFICIENT_GEMM_ROWS = 8192


def _rank_key(c: Candidate) -> tuple:
    """Step time; on a tie, a micro batch of at least 8192 tokens (GEMMs that tall run near
    peak on A100/H100-class GPUs; smaller ones lose efficiency the model does not count),
    then the least memory (most headroom)."""
    rows = c.parallel.micro_batch_size * c.seq_len
    return (float(f"{c.cost.total:.4g}"), rows < EFFICIENT_GEMM_ROWS, c.memory.total)


def search(cfg: Config, n_gpus: int, gpu: GpuSpec) -> tuple[list[Candidate], Candidate | None]:
    """(layouts that fit, best first; the smallest-memory layout overall)."""
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    fitting: list[Candidate] = []
    smallest: Candidate | None = None
    for base in enumerate_parallel(cfg, n_gpus, gpu):
        for ac in CHECKPOINTING:
            par = replace(base, activation_checkpointing=ac)
            if ac != "none" and layout_problems(with_parallel(cfg, par), n_gpus):
                continue  # e.g. op-level selective under expert parallelism
            cand = evaluate(cfg, par, gpu, budget)
            if smallest is None or cand.memory.total < smallest.memory.total:
                smallest = cand
            if cand.fits:
                fitting.append(cand)
                break
    fitting.sort(key=_rank_key)
    return fitting, smallest


def impossible_count_message(cfg: Config, n_gpus: int, gpu: GpuSpec) -> str:
    m = cfg.model
    near = [k for k in range(max(1, n_gpus - 16), n_gpus + 17)
            if k != n_gpus and any(True for _ in enumerate_parallel(cfg, k, gpu))]
    closest = sorted(near, key=lambda k: (abs(k - n_gpus), k))[:4]
    return (f"no layout uses exactly {n_gpus} GPUs: tp must divide n_head={m.n_head}, the KV "
            f"heads, the MLP width, the vocabulary ({padded_vocab_size(m)}) and be <= "
            f"{gpu.gpus_per_node} (a node); pp must divide n_layer={m.n_layer}; dp = "
            f"GPUs / (tp pp) must divide train.global_batch_size="
            f"{cfg.train.global_batch_size}. GPU counts nearby that work: "
            f"{', '.join(map(str, sorted(closest))) or 'none'}." + vocab_hint(cfg, gpu))


def vocab_hint(cfg: Config, gpu: GpuSpec) -> str:
    """Why tensor parallelism is off the table, when the vocabulary is what stops it."""
    m = cfg.model
    with_vocab = tp_options(cfg, gpu, 2**20)
    without = tp_options(cfg, gpu, 2**20, vocab_ok=False)
    if len(without) > len(with_vocab):
        return (f" Tensor parallelism beyond tp={max(with_vocab)} is blocked by the vocabulary"
                f" ({padded_vocab_size(m)} rows): set model.pad_vocab_to=128 to allow tp up to "
                f"{max(without)}.")
    return ""


def min_gpus_to_fit(cfg: Config, gpu: GpuSpec, start: int, limit: int = MAX_GPUS) -> int | None:
    """The smallest power-of-two multiple of ``start`` GPUs at which some layout fits."""
    n = max(1, start)
    while n <= limit:
        n *= 2
        fitting, _ = search(cfg, n, gpu)
        if fitting:
            return n
    return None


def choose_layout(cfg: Config, n_gpus: int, gpu: GpuSpec | str, top: int = 5
                  ) -> tuple[ParallelConfig, list[Candidate]]:
    """The best layout of ``n_gpus`` GPUs of type ``gpu`` for ``cfg`` and the ``top``
    ranked candidates (best first). Raises LayoutError naming the problem and a fix."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if n_gpus < 1:
        raise LayoutError(f"the GPU count must be positive (got {n_gpus})")
    if not any(True for _ in enumerate_parallel(cfg, n_gpus, spec)):
        raise LayoutError(impossible_count_message(cfg, n_gpus, spec))
    fitting, smallest = search(cfg, n_gpus, spec)
    if not fitting:
        assert smallest is not None
        need = min_gpus_to_fit(cfg, spec, n_gpus)
        more = (f"About {need} GPUs of this type would fit it" if need else
                f"No count of {spec.name} up to {MAX_GPUS} fits it")
        raise LayoutError(
            f"{cfg.model.name} does not fit on {n_gpus} x {spec.name} "
            f"({spec.memory_gib:g} GiB, {HEADROOM:.0%} kept free) in any layout: the "
            f"smallest, {smallest.describe()}, needs {smallest.memory.total / 2**30:.1f} GiB "
            f"per GPU. "
            f"{more}; or use a GPU with more memory, or a shorter model.seq_len."
            + vocab_hint(cfg, spec))
    return fitting[0].parallel, fitting[:top]


def why_first(cands: list[Candidate]) -> str:
    """One sentence: what makes the winner faster than the runner-up."""
    if len(cands) < 2:
        return "it is the only layout that fits."
    a, b = cands[0].cost, cands[1].cost
    names = {"compute": "compute", "recompute": "recomputation", "tp_comm": "TP traffic",
             "pp_bubble": "pipeline bubble", "pp_p2p": "pipeline p2p",
             "dp_exposed": "exposed DP traffic", "ep_comm": "EP all-to-all"}
    deltas = sorted(((getattr(b, k) - getattr(a, k), v) for k, v in names.items()),
                    key=lambda x: -abs(x[0]))
    gain = [f"{v} {d * 1e3:+.3g} ms" for d, v in deltas[:3] if abs(d) > 1e-12]
    if float(f"{b.total:.4g}") <= float(f"{a.total:.4g}"):
        return ("it ties with #2 on step time and wins the tie-breaks (a micro batch of at "
                f"least {EFFICIENT_GEMM_ROWS} tokens, then less memory).")
    pct = 100 * (b.total / a.total - 1)
    return (f"#2 ({cands[1].describe()}) is {pct:.1f}% slower per step; #2 minus #1: "
            f"{', '.join(gain)}.")
