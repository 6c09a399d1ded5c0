"""What the decision step decided for a run, as typed frozen values: ``RunDecision``.

``decision/resolve.py`` builds it once, before any data, process group or tensor exists;
the trainer (train/) and the data side (data/: a mixture's per-batch counts and its
per-source sizes) read its fields. plan.json is its serialised form (``as_plan``) plus the
report's extras (sizes, epochs, notes, memory): the plan is written, never read back as
input.

Why here, in config/: the data wing sits below decision/ and may import only config/ and
torch_compat (pyproject.toml's first import-linter contract), and the trainer sits above
both; config/ is the lowest wing that both may import, and these are plain values of the
run's settings, as the rest of config/ is. The layout (parallel.layout.Layout) and the
budget (budget.compute.Budget) stay typed beside it on ``decision.resolve.Resolved``: their
types live above data, and nothing in data/ reads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightStage:
    """A mixture's weights from optimizer step ``step`` on: one per source of
    data.mixture, in its order (step k's batch is the (k+1)-th optimizer step's)."""

    step: int
    weights: tuple[float, ...]

    def as_plan(self) -> list:
        """plan.json's ``mixture_stages`` entry: ``[step, [weights]]``."""
        return [self.step, list(self.weights)]


@dataclass(frozen=True)
class SourceShare:
    """What a run's budget takes from one source of a mixture."""

    name: str
    weights: tuple[float, ...]  # per stage
    tokens: int  # the budget's tokens from it (exact per-batch counts)
    data_tokens: int | None  # its prepared training tokens (None: not prepared yet)

    @property
    def epochs(self) -> float | None:
        return None if not self.data_tokens else self.tokens / self.data_tokens


@dataclass(frozen=True)
class RunDecision:
    """The values a run decided before it starts and its parts read back."""

    lr: float  # the peak LR: optim.lr, scaled by its rule (optim/factory.scaled_lr)
    # the attention backend resolved for this device (model/attention.resolve_backend);
    # None where no device was decided (tools/plan.py's device-independent facts)
    attention: str | None
    precision: str  # precision.name after precision=auto
    branch_points: tuple[int, ...] = ()  # steps a cooldown branch may start from (kept)
    branch_from: str | None = None  # the run this branch continues
    mixture_stages: tuple[WeightStage, ...] = ()  # a mixture's weights over steps
    sources: tuple[SourceShare, ...] = ()  # per source of a mixture, in its order

    def as_plan(self) -> dict:
        """The plan.json keys this decision owns (the rest of the plan is the report's)."""
        out: dict = {"lr": self.lr, "precision": self.precision}
        if self.attention is not None:
            out["attention"] = self.attention
        if self.mixture_stages:
            out["mixture_stages"] = [s.as_plan() for s in self.mixture_stages]
        if self.branch_points:
            out["branch_points"] = list(self.branch_points)
        if self.branch_from:
            out["branch_from"] = self.branch_from
        return out
