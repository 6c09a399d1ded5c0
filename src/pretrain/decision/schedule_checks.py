"""The schedule against the run's length: what only the number of steps can tell, checked
once the budget is known (decision/checks.run_warnings: the run, tools/plan.py), before any data,
weights or process group.

Refused (ConfigError): a ``data.stages`` step at or past the end of the run (that stage never
applies). Said as a warning, and the run goes on: a warmup as long as the run (the LR never
reaches its peak, so it never decays), a WSD decay, and its ``data.cooldown_weights``, that
start while the LR is still warming up, and a spike guard that never arms. Warnings and not
refusals, as torchtitan's scheduler does (it warns when the warmup exceeds the steps, or
warmup plus decay does), because a run shorter than its warmup is sometimes meant: the
smallest points of a scaling ladder (recipes/ladder-*.yaml) and the few-step smoke runs
under the default ``schedule.warmup_steps=50``. Megatron asserts warmup < decay steps; here
the warning names both numbers and the fix, in the log and in the plan (``warnings``, with
decision/checks.run_warnings).
"""

from __future__ import annotations

from pretrain.budget.compute import Budget
from pretrain.config.schema import Config, ConfigError
from pretrain.optim.factory import warmup_steps, wsd_decay_start


def _steps_text(budget: Budget) -> str:
    return (f"{budget.steps} steps ({budget.rule} / {budget.global_batch_tokens:,} tokens "
            "a step)")


def _warmup_key(cfg: Config) -> str:
    s = cfg.schedule
    return (f"schedule.warmup_tokens={s.warmup_tokens}" if s.warmup_tokens is not None
            else f"schedule.warmup_steps={s.warmup_steps}")


def schedule_problems(cfg: Config, budget: Budget) -> list[str]:
    """What cannot be meant: a mixture stage at or past the end of the run."""
    return [f"data.stages[{i}].step={st.step} is past the end of this run, "
            f"{_steps_text(budget)}: that stage would never apply; give it a step below "
            f"{budget.steps}, drop it, or raise the budget"
            for i, st in enumerate(cfg.data.stages) if int(st.step) >= budget.steps]


def _warmup_warnings(cfg: Config, budget: Budget) -> list[str]:
    warmup = warmup_steps(cfg.schedule, budget.global_batch_tokens)
    w = []
    if warmup >= budget.steps:
        w.append(f"{_warmup_key(cfg)} ({warmup} steps) is not shorter than this run, "
                 f"{_steps_text(budget)}: the LR never reaches its peak optim.lr and never "
                 f"decays; set schedule.warmup_steps={max(1, budget.steps // 10)} (a tenth "
                 "of the run) or raise the budget")
    start = wsd_decay_start(budget.steps, cfg.schedule)
    if cfg.schedule.decay == "wsd" and warmup > start:
        mix = (" and data.cooldown_weights (the cooldown mix)" if cfg.data.cooldown_weights
               else "")
        w.append(
            f"the WSD decay{mix} start{'' if mix else 's'} at step {start} of {budget.steps} "
            "(schedule."
            f"decay_fraction={cfg.schedule.decay_fraction}), while {_warmup_key(cfg)} "
            f"still warms the LR up until step {warmup}: it starts before the LR's peak; "
            f"set schedule.warmup_steps={max(1, start // 2)} or lower, or raise the "
            "budget"
        )
    return w


def schedule_warnings(cfg: Config, budget: Budget) -> list[str]:
    """What is probably not meant but runs: see the module's docstring."""
    w = _warmup_warnings(cfg, budget)
    o = cfg.optim
    if o.spike_guard and o.spike_warmup >= budget.steps:
        w.append(f"optim.spike_warmup={o.spike_warmup} counted steps is not shorter than "
                 f"this run's {budget.steps} steps: the spike guard never arms (it skips "
                 f"nothing); set optim.spike_warmup={max(2, budget.steps // 4)} (and "
                 "optim.spike_window at least that), or optim.spike_guard=false")
    return w


def check_schedule(cfg: Config, budget: Budget) -> list[str]:
    """Raise ConfigError for the problems; return the warnings (the caller logs them and
    puts them in the plan)."""
    if problems := schedule_problems(cfg, budget):
        raise ConfigError(problems)
    return schedule_warnings(cfg, budget)
