"""The loop's seam: a service beside the training loop is a ``Hook`` (OLMo-core's
``Callback``, Lightning's callbacks), called at fixed points of ``Trainer.fit``. A new service
(task evaluation, a spike guard, a profiler) attaches by subclassing ``Hook`` and being named
in ``services.build_hooks``; the loop itself does not grow.

Every rank calls every method at the same points (a hook may run collectives in them); rank 0
alone logs and writes files (``trainer.rank0``). A hook adds what it measured to the dict it
is handed: the keys reach the log line, metrics.jsonl and wandb (``metrics``) or result.json
(``result``). Its ``state_dict`` is saved in each checkpoint's meta.json under the hook's
``name`` and handed back to ``load_state_dict`` on resume, so a resumed run continues as the
uninterrupted one would.
"""

from __future__ import annotations

from typing import Any


class Hook:
    """A service the loop calls; every method is optional (the base does nothing)."""

    name: str = "hook"  # the key of its state in meta.json and of its section in the plan

    def start(self, trainer: Any) -> None:
        """After resume, before the first step (``trainer.step`` is where the run starts)."""

    def step_end(self, trainer: Any, metrics: dict | None) -> None:
        """After every optimizer step; ``metrics`` is the log line's dict on logging steps
        (add keys to it), None on the others."""

    def evaluate(self, trainer: Any, metrics: dict) -> None:
        """At every evaluation point (step 0 and every ``train.eval_interval``, and the
        last step), after the validation loss: add keys to ``metrics``."""

    def finish(self, trainer: Any, result: dict) -> None:
        """The budget is spent: add keys to ``result`` (result.json)."""

    def state_dict(self) -> dict:
        """What a resumed run needs to continue exactly (JSON-serialisable)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s value (a checkpoint saved before this hook existed
        gives nothing: the hook starts fresh)."""

    def close(self) -> None:
        """Give back what the hook holds (threads, files), whatever happened."""
