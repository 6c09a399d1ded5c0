"""The global batch over a run: a ramp from a small batch to the full one (``batch_ramp``).

Why: early in a run the gradient noise scale (the critical batch, McCandlish et al. 2018) is
small, so a large batch spends tokens a small one would not need; later it is large, so a
small batch spends steps. GPT-3 grew its batch linearly from 32k tokens over the first 4-12B
tokens (Brown et al. 2020, app. B), DeepSeek-V3 from 3,072 to 15,360 sequences over 469B
tokens, and Merrill et al. 2025 grow it with the measured critical batch.

The rules, each stated once here (docs/batch-ramp.md):

* Every batch is a whole number of ``start`` batches (or the full batch), and ``start`` a
  whole number of ``unit`` = micro batch x dp (x pp: a pipeline's micro batch count stays a
  multiple of its ranks) sequences (``batch_ramp.start_tokens`` rounded up to it): a larger batch is
  more micro batches (gradient accumulation), never a larger
  micro batch, so no tensor changes shape (a compiled model never recompiles for the ramp).
  The ramp's batches depend on the layout only through that rounding: a run resumed on a
  layout whose unit also divides ``start`` takes the same batches.
* The sample stream is the fixed-batch run's: step ``k`` reads the ``B_k`` samples that
  follow the ``samples`` consumed before it (the data position stays global samples
  consumed), and the run ends at the fixed-batch run's samples, the last step cut to what
  is left. A ``tokens`` ramp's batch is a pure function of the samples consumed; a
  ``noise_scale`` ramp's is its state (the current batch), saved with each checkpoint.
* ``tokens``: from ``start`` to ``full`` over the first ``ramp_samples``, linear in the
  samples consumed (rounded down to whole ``start`` batches), or in ``stages`` equal
  stages.
* ``noise_scale``: on a logging step whose smoothed B_simple is at least ``factor`` x the
  current batch (tokens), after ``min_measurements`` measurements at that batch, the batch
  doubles (up to ``full``). With the default factor 2 a doubled batch is still at most
  B_simple, the critical batch's estimate.
* The LR at batch B is the full batch's x ``lr_factor``: sqrt(B / full) for the Adam
  family, LAMB and Muon, B / full for SGD and LARS (``OptimizerSpec.ramp_lr``); the
  schedule (warmup, decay) runs in tokens (optim/factory.lr_multiplier_tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pretrain.errors import UserError


class RampError(UserError, ValueError):
    """A batch_ramp setting that cannot work with this run."""


def lr_factor(rule: str, batch: int, full: int) -> float:
    """The LR at a batch of ``batch`` over the full batch's (``full``, same unit)."""
    if rule == "none" or batch == full:
        return 1.0
    if rule == "sqrt":
        return math.sqrt(batch / full)
    if rule == "linear":
        return batch / full
    raise ValueError(f"unknown LR rule {rule!r}")


@dataclass(frozen=True)
class RampSpec:
    """A run's ramp, resolved: every size in sequences."""

    kind: str  # tokens | noise_scale
    unit: int  # micro batch x dp: every batch is a multiple
    start: int
    full: int
    total_samples: int  # the fixed-batch run's samples: the run ends there
    seq_len: int
    lr_rule: str  # none | sqrt | linear
    ramp_samples: int = 0  # tokens: samples over which the batch reaches full
    stages: int = 0  # tokens: 0 = linear, n = n equal stages
    factor: float = 2.0  # noise_scale
    min_measurements: int = 3  # noise_scale

    def tokens_batch(self, samples: int) -> int:
        """The ``tokens`` ramp's batch of the step that starts after ``samples`` samples."""
        if samples >= self.ramp_samples:
            b = self.full
        else:
            grow = self.full - self.start
            if self.stages:
                b = self.start + grow * (samples * self.stages // self.ramp_samples) // self.stages
            else:
                b = self.start + grow * samples // self.ramp_samples
            b = min(self.full, max(self.start, b // self.start * self.start))
        return min(b, self.total_samples - samples)

    def lr_factor(self, batch: int) -> float:
        return lr_factor(self.lr_rule, batch, self.full)


def ramp_spec(cfg, layout, full_steps: int) -> RampSpec | None:
    """The run's ramp from ``cfg.batch_ramp`` (None: ``none``) for ``layout`` (its unit)
    and the fixed-batch run of ``full_steps`` steps; RampError names a setting that does
    not fit."""
    r = cfg.batch_ramp
    if r.name == "none":
        return None
    from pretrain.optim.specs import spec as optimizer_spec

    seq, full = cfg.model.seq_len, cfg.train.global_batch_size
    # a pipeline's micro batch count stays a multiple of its ranks (every schedule fills)
    unit = layout.micro_batch_size * layout.dp * layout.pp
    if not r.start_tokens or r.start_tokens <= 0:
        raise RampError(f"batch_ramp={r.name} needs batch_ramp.start_tokens > 0 (the first "
                        "step's batch in tokens, e.g. 32768)")
    if full % unit:
        raise RampError(f"batch_ramp under pp={layout.pp} needs train.global_batch_size={full} "
                        f"to be a multiple of micro batch x dp x pp = {unit} (each step's "
                        "pipeline micro batches a multiple of its ranks): change one of them")
    start = min(full, max(unit, math.ceil(r.start_tokens / seq / unit) * unit))
    rule = str(r.lr_scaling)
    if rule == "auto":
        rule = optimizer_spec(cfg.optim.name).ramp_lr
    common = dict(unit=unit, start=start, full=full, total_samples=full_steps * full,
                  seq_len=seq, lr_rule=rule)
    if r.name == "tokens":
        if not r.ramp_tokens or r.ramp_tokens <= 0:
            raise RampError("batch_ramp=tokens needs batch_ramp.ramp_tokens > 0 (the tokens "
                            "over which the batch reaches train.global_batch_size)")
        if r.stages < 0:
            raise RampError(f"batch_ramp.stages={r.stages}: use 0 (linear) or a count > 0")
        return RampSpec("tokens", **common, ramp_samples=math.ceil(r.ramp_tokens / seq),
                        stages=r.stages)
    if r.factor <= 1 or r.min_measurements < 1:
        raise RampError(f"batch_ramp=noise_scale needs batch_ramp.factor > 1 (got {r.factor})"
                        f" and batch_ramp.min_measurements >= 1 (got {r.min_measurements})")
    if not cfg.train.noise_scale:
        raise RampError("batch_ramp=noise_scale follows the measured noise scale: set "
                        "train.noise_scale=true (or batch_ramp=tokens)")
    return RampSpec("noise_scale", **common, factor=r.factor,
                    min_measurements=r.min_measurements)


@dataclass
class BatchRamp:
    """A run's batch, step by step: ``batch(samples)`` before each step, ``observe`` the
    noise scale on logging steps (``noise_scale``). Its state (``state_dict``) is saved
    with the checkpoint so a resumed run continues as the uninterrupted one."""

    spec: RampSpec
    current: int = 0  # noise_scale: the batch now (sequences)
    measurements: int = 0  # noise_scale: measurements since the last change
    changes: list[list[int]] = field(default_factory=list)  # [step, samples, new batch]

    def __post_init__(self):
        self.current = self.current or self.spec.start

    def batch(self, samples: int) -> int:
        """Global sequences of the step that starts after ``samples`` samples."""
        if self.spec.kind == "tokens":
            return self.spec.tokens_batch(samples)
        return min(self.current, self.spec.total_samples - samples)

    def observe(self, step: int, samples: int, noise_tokens: float | None) -> bool:
        """A logging step's smoothed B_simple (tokens; None: not defined yet): True when the
        batch changes for the next step (``noise_scale`` only)."""
        s = self.spec
        if s.kind != "noise_scale" or noise_tokens is None or self.current >= s.full:
            return False
        self.measurements += 1
        if (
            self.measurements < s.min_measurements
            or noise_tokens < s.factor * self.current * s.seq_len
        ):
            return False
        self.current = min(s.full, 2 * self.current)
        self.measurements = 0
        self.changes.append([step, samples, self.current])
        return True

    def state_dict(self) -> dict:
        return {"current": self.current, "measurements": self.measurements,
                "changes": [list(c) for c in self.changes]}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.current = int(state["current"]) or self.spec.start
            self.measurements = int(state["measurements"])
            self.changes = [list(map(int, c)) for c in state["changes"]]


def tokens_stages(spec: RampSpec) -> list[dict]:
    """A ``tokens`` ramp's steps grouped by batch: each stage's batch (sequences), steps,
    first sample and samples, to the run's end."""
    stages: list[dict] = []
    samples = 0
    while samples < spec.total_samples:
        b = spec.tokens_batch(samples)
        if samples >= spec.ramp_samples and b == spec.full:  # the rest at the full batch
            n = (spec.total_samples - samples) // b
            _add(stages, b, n, samples)
            samples += n * b
            continue
        _add(stages, b, 1, samples)
        samples += b
    return stages


def _add(stages: list[dict], batch: int, steps: int, first: int) -> None:
    if stages and stages[-1]["batch"] == batch:
        stages[-1]["steps"] += steps
        stages[-1]["samples"] += steps * batch
    else:
        stages.append({"batch": batch, "steps": steps, "first_sample": first,
                       "samples": steps * batch})


def describe(spec: RampSpec, peak_lr: float, full_steps: int, asked: int | None = None
             ) -> dict:
    """The plan's ``batch_ramp`` entry: the ramp, each stage (tokens, steps, batch, the
    peak LR at that batch) and the steps in all, against the fixed batch's; ``asked``:
    batch_ramp.start_tokens, said when the layout rounds it."""
    seq = spec.seq_len
    out = {"kind": spec.kind, "start_tokens": spec.start * seq,
           **({"start_tokens_asked": asked} if asked and asked != spec.start * seq else {}),
           "full_tokens": spec.full * seq, "unit_tokens": spec.unit * seq,
           "lr_scaling": spec.lr_rule, "steps_fixed_batch": full_steps,
           "recompiles": 0}
    if spec.kind == "tokens":
        stages = tokens_stages(spec)
        out.update(ramp_tokens=spec.ramp_samples * seq, linear=spec.stages == 0,
                   steps=sum(s["steps"] for s in stages),
                   stages=[{"from_tokens": s["first_sample"] * seq,
                            "tokens": s["samples"] * seq, "steps": s["steps"],
                            "batch": s["batch"], "batch_tokens": s["batch"] * seq,
                            "peak_lr": peak_lr * spec.lr_factor(s["batch"])}
                           for s in stages])
    else:
        out.update(factor=spec.factor, min_measurements=spec.min_measurements,
                   steps_at_most=math.ceil(spec.total_samples / spec.start),
                   start_peak_lr=peak_lr * spec.lr_factor(spec.start))
    return out


def describe_line(entry: dict) -> str:
    """The plan's ``batch_ramp`` entry in a few lines, for the dry run and the log."""
    if entry["kind"] == "noise_scale":
        return (f"batch ramp (noise_scale): from {entry['start_tokens']:,} tokens, doubling "
                f"when the smoothed noise scale is {entry['factor']:g}x the batch, up to "
                f"{entry['full_tokens']:,} tokens; LR x {entry['lr_scaling']}(B / full); at "
                f"most {entry['steps_at_most']:,} steps ({entry['steps_fixed_batch']:,} at "
                f"the full batch); 0 recompiles (the micro batch keeps its shape)")
    stages = entry["stages"]
    rounded = (f" (batch_ramp.start_tokens={entry['start_tokens_asked']:,} rounded to whole "
               f"micro batches x dp x pp)") if "start_tokens_asked" in entry else ""
    shown = stages if len(stages) <= 8 else stages[:4] + [None] + stages[-3:]
    lines = [f"batch ramp (tokens, {'linear' if entry['linear'] else 'stages'}): from "
             f"{entry['start_tokens']:,}{rounded} to {entry['full_tokens']:,} tokens over "
             f"{entry['ramp_tokens']:,} tokens, in steps of {entry['start_tokens']:,}; LR x "
             f"{entry['lr_scaling']}(B / full); {entry['steps']:,} steps "
             f"({entry['steps_fixed_batch']:,} at the full batch); 0 recompiles"]
    for s in shown:
        lines.append("  ..." if s is None else
                     f"  from token {s['from_tokens']:,}: {s['steps']:,} steps of "
                     f"{s['batch_tokens']:,} tokens ({s['batch']} sequences), "
                     f"{s['tokens']:,} tokens, peak LR {s['peak_lr']:.4g}")
    return "\n".join(lines)


def planned_steps(spec: RampSpec) -> int:
    """The steps a ramp takes: a ``tokens`` ramp's exactly; a ``noise_scale`` ramp's are
    decided while it runs: those at the full batch, the fewest it can take."""
    if spec.kind == "tokens":
        return sum(s["steps"] for s in tokens_stages(spec))
    return math.ceil(spec.total_samples / spec.full)
