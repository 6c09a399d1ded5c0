"""The planner's host term against the trainer's step timed on this CPU
(``python tools/host_time.py``).

On the CPU the host work of a step is what it is on a GPU machine's host (Python, the
dispatcher, autograd, the trainer's loop) without a kernel launch; what differs is the
kernels' own time, which runs inline here. So each model is timed at a shape where the
kernels cost nearly nothing and its host work is kept: its structure (layers, heads,
vocabulary, tied embeddings, parameter tensors: what ``dispatch.count_ops`` and
``host.outside_ops`` count) at 8 channels a head, 16 tokens, one micro batch, fp32 (no
autocast: the op counts are taken without it), fused AdamW (as on a GPU).

The CPU's costs (``calibration.HostCosts``) are calibrated on one model, nano (eager: an
op's cost, a parameter tensor's in clipping and the optimizer, and the loop's Python;
compiled: a kernel launch's and a graph input's, its graph's time split by a profile), and
predict the others: the tiny model and the 10M rung, eager and compiled, are out of sample.
"""

from __future__ import annotations

from dataclasses import dataclass

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
}
CALIBRATED_ON = "nano"
# the shape where kernels cost nothing and the host's work is the model's own
SHAPE = ("model.seq_len=16", "parallel.micro_batch_size=1", "train.global_batch_size=1",
         "precision=fp32", "optim.fused=true", "train.device=cpu")
HEAD_CHANNELS = 8
# planned / measured within this on every row (the bar)
TOLERANCE = 0.20


def overrides(model: str, compiled: bool) -> list[str]:
    cfg = compose_config(list(MODELS[model]))
    return [*MODELS[model], *SHAPE, f"model.d_model={HEAD_CHANNELS * cfg.model.n_head}",
            f"train.compile={str(compiled).lower()}"]


def config(model: str, compiled: bool) -> tuple[Config, Layout]:
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


def _ops(cfg: Config, layout: Layout) -> tuple[int, int]:
    """(the forward/backward region's ops for one micro batch, ops outside it a step)."""
    c = count_ops(cfg.model)
    region = c.outside + cfg.model.n_layer * c.per_block + c.loss_base  # one chunk: plain
    return region, sum(outside_ops(cfg, layout).values())


def calibrate(eager: Measured, compiled: Measured) -> HostCosts:
    """This CPU's costs from one model's eager and compiled steps: an op's cost from the
    eager forward/backward region (its ops and an ``AccumulateGrad`` a parameter tensor),
    a parameter tensor's in clipping and the optimizer step (their time, less their own
    ops, over the tensors), the loop's Python from what is left of the step (less the
    bookkeeping's ops); then the compiled graph's host time (the compiled step less what
    runs outside the graph), split by its profile's ``launch_share`` into its kernels'
    launches and its inputs' guards and wrappers (``host.graph_calls`` counts both)."""
    cfg, layout = config(eager.model, False)
    region, _ = _ops(cfg, layout)
    kinds, mb = outside_ops(cfg, layout), layout.microbatches
    per_op = eager.region_s / (mb * region + kinds["AccumulateGrad"])
    per_tensor = (eager.update_s - kinds["clipping and the optimizer"] * per_op) / (
        kinds["clipping's .to"])
    loop = (eager.step_s - eager.region_s - eager.update_s
            - kinds["bookkeeping"] * per_op)
    costs = HostCosts(per_op, GPU_HOST.per_launch, 0.0, loop, per_tensor)
    ccfg, clayout = config(compiled.model, True)
    graph = (compiled.step_s - outside_seconds(ccfg, clayout, costs)) / mb
    launches, inputs = graph_calls(ccfg, clayout)
    return HostCosts(per_op, compiled.launch_share * graph / launches, 0.0, loop, per_tensor,
                     (1 - compiled.launch_share) * graph / inputs)


def predict(model: str, compiled: bool, costs: HostCosts) -> float:
    cfg, layout = config(model, compiled)
    return host_seconds(cfg, layout, wrapped=False, costs=costs)


def rows(measured: list[Measured], costs: HostCosts) -> list[dict]:
    out = []
    for m in measured:
        planned = predict(m.model, m.compiled, costs)
        out.append({"model": m.model, "step": "compiled" if m.compiled else "eager",
                    "measured_ms": 1e3 * m.step_s, "planned_ms": 1e3 * planned,
                    "ratio": planned / m.step_s, "calibration": m.model == CALIBRATED_ON,
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
                 f"{1e6 * costs.per_tensor:.2f} us a parameter tensor in clipping and the "
                 "optimizer, "
                 f"{1e6 * costs.per_input:.2f} us a compiled graph's input, "
                 f"{1e6 * costs.per_launch:.2f} us a compiled kernel's launch, "
                 f"{1e3 * costs.loop:.3f} ms of loop a step.")
    return "\n".join(lines)
