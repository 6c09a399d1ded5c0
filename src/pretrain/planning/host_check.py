"""The planner's host term against the trainer's step timed on this CPU
(``python tools/host_time.py``).

On the CPU the host work of a step is what it is on a GPU machine's host (Python, the
dispatcher, autograd, the trainer's loop) without a kernel launch; what differs is the
kernels' own time, which runs inline here. So each model is timed at a shape where the
kernels cost nearly nothing and its host work is kept: its structure (layers, heads,
vocabulary, tied embeddings, parameter tensors: what ``dispatch.count_ops`` and
``host.outside_ops`` count) at 2 channels a head, 16 tokens, one micro batch, fp32 (no
autocast: the op counts are taken without it), fused AdamW (as on a GPU). At 8 channels a
head the kernels did not cost nothing: the 10M rung's step took 25% longer than at 2 and
the tiny model's 40% (nano's 2%: its d_model was 16), kernel time that no host term holds
(docs/planning.md).

The CPU's costs (``calibration.HostCosts``) are calibrated on nano at two depths, its own 2
layers and 16 (``CALIBRATED_ON``): what a layer adds gives the per-unit costs (an op, a
parameter tensor's share of what runs outside the region, a compiled graph's kernel
launch and input, split by a profile), and what nano's step leaves besides its units gives
the fixed parts (the eager region's, the compiled graph's, the loop's). Calibrated on nano
alone, its fixed part (half its step: the loss over the 4096-token vocabulary, the
optimizer's call, the loop) was charged per op and per tensor, and a deeper model came out
too slow. The tiny model and the 10M rung (other heads, widths and depths) are predicted.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace

from pretrain.config.compose import compose_config
from pretrain.config.schema import Config
from pretrain.parallel.layout import Layout, resolve_layout
from pretrain.planning.calibration import GPU_HOST, HostCosts
from pretrain.planning.cost import host_seconds
from pretrain.planning.dispatch import count_ops
from pretrain.planning.host import graph_calls, outside_ops, outside_seconds

# each model as its recipe runs it (the 10M rung: docs/benchmarks.md, "One H200")
MODELS = {
    "nano": ("+recipe=tiny", "model=nano"),
    "tiny": ("+recipe=tiny",),
    "10M": ("+recipe=tiny", "model.d_model=320", "model.n_layer=8", "model.n_head=5",
            "model.seq_len=512"),
    "nano-16": ("+recipe=tiny", "model=nano", "model.n_layer=16"),  # calibration only
}
# nano and nano 16 layers deep: a layer's cost and the fixed part (``calibrate``)
CALIBRATED_ON = ("nano", "nano-16")
# the shape where kernels cost nothing and the host's work is the model's own
SHAPE = ("model.seq_len=16", "parallel.micro_batch_size=1", "train.global_batch_size=1",
         "precision=fp32", "optim.fused=true", "train.device=cpu")
HEAD_CHANNELS = 2
# planned / measured within this on every row (the bar)
TOLERANCE = 0.20


def overrides(model: str, compiled: bool) -> list[str]:
    return list(_overrides(model, compiled))


@functools.cache
def _overrides(model: str, compiled: bool) -> tuple[str, ...]:
    cfg = compose_config(list(MODELS[model]))
    return (*MODELS[model], *SHAPE, f"model.d_model={HEAD_CHANNELS * cfg.model.n_head}",
            f"train.compile={str(compiled).lower()}")


def config(model: str, compiled: bool) -> tuple[Config, Layout]:
    """``model``'s config at the measured shape and its one-process layout (a copy: composed
    once a process, not at each of the calibration's and the table's dozens of asks)."""
    return copy.deepcopy(_config(model, compiled))


@functools.cache
def _config(model: str, compiled: bool) -> tuple[Config, Layout]:
    cfg = compose_config(overrides(model, compiled))
    return cfg, resolve_layout(cfg, 1)


@dataclass(frozen=True)
class Measured:
    """One model's step, timed: seconds a step, and of it the forward/backward region's and
    clipping's and the optimizer step's."""

    model: str
    compiled: bool
    step_s: float
    region_s: float
    update_s: float
    # compiled: of the graph's host time, the share inside inductor's generated code (its
    # kernels' calls; the rest the guards and AOTAutograd's wrappers), from a profile
    launch_share: float = 0.0


def calibrate(measured: list[Measured]) -> HostCosts:
    """This CPU's costs from nano's steps at its two depths (``CALIBRATED_ON``), eager and
    compiled: each cost's per-unit part from what the deeper step adds, its fixed part from
    what the shallower step leaves. Eager: an op's cost from the forward/backward region
    (its ops and an ``AccumulateGrad`` a parameter tensor), a parameter tensor's from the
    rest of the step (clipping, the optimizer, ``zero_grad``; less their own ops and the
    bookkeeping's), the region's and the loop's fixed parts what nano leaves. Compiled:
    the graph's time (the step less what runs outside it, as eager), what a layer adds split
    by the deeper step's profile (``launch_share``) into its kernels' launches and its
    inputs' guards and wrappers (``host.graph_calls`` counts both), the rest the graph's
    fixed part."""
    step = {(m.model, m.compiled): m for m in measured}
    a, b = CALIBRATED_ON
    (ops_a, tensors_a, fixed_ops), (ops_b, tensors_b, _) = _units(a), _units(b)
    ea, eb = step[a, False], step[b, False]
    per_op = (eb.region_s - ea.region_s) / (ops_b - ops_a)
    per_tensor = ((eb.step_s - eb.region_s) - (ea.step_s - ea.region_s)) / (tensors_b - tensors_a)
    costs = HostCosts(per_op, GPU_HOST.per_launch, 0.0,
                      ea.step_s - ea.region_s - fixed_ops * per_op - tensors_a * per_tensor,
                      per_tensor, per_region=ea.region_s - ops_a * per_op)
    (launches_a, inputs_a), (launches_b, inputs_b) = (graph_calls(*config(m, True))
                                                      for m in CALIBRATED_ON)
    graph_a, graph_b = (step[m, True].step_s - outside_seconds(*config(m, True), costs)
                        for m in CALIBRATED_ON)
    share = step[b, True].launch_share
    per_launch = share * (graph_b - graph_a) / (launches_b - launches_a)
    per_input = (1 - share) * (graph_b - graph_a) / (inputs_b - inputs_a)
    return replace(costs, per_launch=per_launch, per_input=per_input,
                   per_graph=graph_a - launches_a * per_launch - inputs_a * per_input)


def _units(model: str) -> tuple[int, int, int]:
    """(the eager region's ops and ``AccumulateGrad``s, parameter tensors, the ops outside
    it besides those: clipping's and the optimizer's, the bookkeeping) of ``model``."""
    cfg, layout = config(model, False)
    c, kinds = count_ops(cfg.model), outside_ops(cfg, layout)
    region = c.outside + cfg.model.n_layer * c.per_block + c.loss_base  # one chunk: plain
    return (region + kinds["AccumulateGrad"], kinds["clipping's .to"],
            kinds["clipping and the optimizer"] + kinds["bookkeeping"])


def predict(model: str, compiled: bool, costs: HostCosts) -> float:
    cfg, layout = config(model, compiled)
    return host_seconds(cfg, layout, wrapped=False, costs=costs)


def rows(measured: list[Measured], costs: HostCosts) -> list[dict]:
    out = []
    for m in measured:
        planned = predict(m.model, m.compiled, costs)
        out.append({"model": m.model, "step": "compiled" if m.compiled else "eager",
                    "measured_ms": 1e3 * m.step_s, "planned_ms": 1e3 * planned,
                    "ratio": planned / m.step_s, "calibration": m.model in CALIBRATED_ON,
                    "ok": abs(planned / m.step_s - 1) <= TOLERANCE})
    return out


def markdown(table: list[dict], costs: HostCosts) -> str:
    lines = ["| model | step | measured ms | planned ms | planned/measured | |",
             "|---|---|---|---|---|---|"]
    for r in table:
        note = "calibration" if r["calibration"] else ("ok" if r["ok"] else "OFF")
        lines.append(f"| {r['model']} | {r['step']} | {r['measured_ms']:.2f} | "
                     f"{r['planned_ms']:.2f} | {r['ratio']:.3f} | {note} |")
    lines.append("")
    lines.append(f"This CPU's costs: {1e6 * costs.per_op:.2f} us an op, "
                 f"{1e6 * costs.per_tensor:.2f} us a parameter tensor outside the region "
                 "(clipping, the optimizer, zero_grad), "
                 f"{1e6 * costs.per_input:.2f} us a compiled graph's input, "
                 f"{1e6 * costs.per_launch:.2f} us a compiled kernel's launch; fixed: "
                 f"{1e3 * costs.per_region:.3f} ms the eager region's, "
                 f"{1e3 * costs.per_graph:.3f} ms the compiled graph's, "
                 f"{1e3 * costs.loop:.3f} ms the loop's a step.")
    return "\n".join(lines)
