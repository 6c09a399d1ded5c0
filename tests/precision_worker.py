"""Train precision jobs step by step, recording what tests/test_precision.py compares, with an
optional non-finite gradient injected on one rank at one step.

Run as ``python tests/forked_ranks.py N tests/precision_worker.py OUT SPEC``
(SPEC: helpers.write_spec's file, {"jobs": {name: {"config": Config, "steps": null | n,
"inject": null | {"step": k, "rank": r, "how": "forward" | "shard"}}}};
``steps``: stop after n steps of the budget's schedule). Jobs run one after
the other in the same processes (one start-up for all of them); every rank writes
OUT/<name>.rank<r>.pt. The test module also calls ``run_steps`` in its own process.

Injections, on rank ``r`` only and only at step index ``k`` (0-based), so the other ranks
compute finite gradients:
  * ``forward``: the model's output (the logits) is multiplied by inf, so this rank's loss
    and every gradient it computes are non-finite (an fp16 overflow in its forward and
    backward; the data-parallel reduction then spreads it to the other ranks' shards);
  * ``shard``: after backward and the data-parallel reduction, one element of this rank's
    local gradient shard is set to inf, so no other rank holds a non-finite value and only
    an agreement between the ranks can make them all skip the step.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from pretrain.train.trainer import Trainer


class Collect(logging.Handler):
    """The warnings of the 'pretrain' logger, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole model's parameters, on every rank (a collective: all ranks call it)."""
    sd = get_model_state_dict(trainer.module.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def local_shards(trainer: Trainer) -> list[torch.Tensor]:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for p in trainer.module.parallel.parameters()]


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def poison_local_grad(trainer: Trainer) -> None:
    """Set one element of this rank's local gradient shard to inf."""
    for p in reversed(trainer.module.parallel.parameters()):
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if grad is not None and grad.numel() > 0:
            grad.view(-1)[0] = float("inf")
            return
    raise RuntimeError("no local gradient to poison")


def block_output_dtype(trainer: Trainer) -> torch.dtype:
    """The dtype a block's first Linear produces in a training forward (one process under
    mixed precision: autocast; a multi-process layout: FSDP2 gathers the weights in the
    compute dtype)."""
    seen: list[torch.dtype] = []
    block = next(iter(trainer.module.model.layers.values()))
    linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    x, _ = trainer._local_batch()
    trainer.module.parallel.train()
    with torch.no_grad(), trainer.module.autocast():
        trainer.module.model(x[:1])
    hook.remove()
    return seen[0]


def run_steps(trainer: Trainer, inject: dict | None = None,
              snapshot_at: int | None = None, steps: int | None = None) -> dict:
    """Train ``trainer`` (set up) ``steps`` steps (default: its budget); per step the loss,
    grad norm, loss scale after the step, and whether this rank's local parameter shards
    and the full (gathered) parameters changed. Also: skipped_steps, the warnings logged, the full
    parameters after
    ``snapshot_at`` steps and at the end, and whether each block is compiled."""
    from torch._dynamo.utils import counters

    rank = dist.get_rank() if dist.is_initialized() else 0
    inject = inject or {}
    armed = {"on": False}
    if inject and inject["rank"] == rank:
        if inject["how"] == "forward":
            trainer.module.model.register_forward_hook(
                lambda mod, args, output: output * float("inf") if armed["on"] else None)
        elif inject["how"] == "shard":
            real = trainer.module.strategy.forward_backward

            def poisoned(x, y, measure=False):
                loss, small = real(x, y, measure)
                if armed["on"]:
                    with torch.no_grad():
                        poison_local_grad(trainer)
                return loss, small

            trainer.module.strategy.forward_backward = poisoned
        else:
            raise ValueError(inject["how"])
    handler = Collect()
    logging.getLogger("pretrain").addHandler(handler)
    records: list[dict] = []
    snapshot = None
    try:
        for i in range(steps or trainer.budget.steps):
            armed["on"] = i == inject.get("step", -1)
            full_before, local_before = full_params(trainer), local_shards(trainer)
            loss, norm = trainer.train_step()
            full_after, local_after = full_params(trainer), local_shards(trainer)
            records.append({
                "loss": loss, "grad_norm": norm,
                "scale": trainer.module.scaler.get_scale() if trainer.module.scaler else None,
                "full_changed": not same(full_before, full_after),
                "local_changed": not same(local_before, local_after),
            })
            if i + 1 == snapshot_at:
                snapshot = full_after
    finally:
        logging.getLogger("pretrain").removeHandler(handler)
    return {
        "steps": records, "losses": [s["loss"] for s in records],
        "grad_norms": [s["grad_norm"] for s in records],
        "skipped_steps": trainer.module.skipped_steps, "warnings": handler.messages,
        "snapshot": snapshot, "final": full_params(trainer),
        "scaler": type(trainer.module.scaler).__name__,
        # the compiled module is the block as registered: under activation checkpointing
        # the checkpoint wrapper, compiled with its region inside (parallel/apply.py)
        "compiled": [getattr(b, "_compiled_call_impl", None) is not None
                     for b in trainer.module.model.layers.values()],
        "root_compiled": getattr(trainer.module.model, "_compiled_call_impl", None) is not None,
        # one process: the model and its loss compiled together (parallel/apply.py)
        "whole_compiled": trainer.module.parallel.train_loss is not None,
        "dynamo": {"frames": dict(counters["frames"]), "stats": dict(counters["stats"]),
                   "graph_break": dict(counters["graph_break"])},
    }


def main() -> None:
    from helpers import read_spec
    from torch._dynamo.utils import counters

    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    for name, job in spec["jobs"].items():
        counters.clear()
        torch._dynamo.reset()  # each job compiles afresh (stale caches of an earlier job's
        # blocks made inductor recurse without end when two compile jobs shared a process)
        trainer = Trainer(job["config"], out / name)
        trainer.setup()
        record = run_steps(trainer, job["inject"], steps=job["steps"])
        torch.save(record, out / f"{name}.rank{dist.get_rank()}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
