"""Train a few steps of one or more layouts in this process and dump what tests compare.

Run as ``python tests/forked_ranks.py N tests/parallel_worker.py OUT SPEC``
(helpers.run_ranks; torchrun runs it as well; SPEC: helpers.write_spec's file,
{"configs": {name: Config}, "eval_also": [eval_batches, ...]}: after training, evaluate
again with each of those), or called in the test's process (helpers.run_group) for one
process. Every layout of one world size runs in the same
processes, one after the other, to pay the start-up (importing torch N times on a small
CPU) once.

For each layout, rank 0 writes OUT/<name>.pt: per-step losses and grad norms, the
validation loss and how many batches it averaged (also per ``eval_also`` value), the full
parameters after initialisation and after training (gathered from every shard and stage),
and per rank the local bytes of parameters, gradients, optimizer state and the pipeline
outputs the schedule keeps (measured just before the last optimizer step, when all of them
exist) and peak RSS.
"""

from __future__ import annotations

import gc
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import read_spec
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from pretrain.config.schema import Config
from pretrain.parallel import pipeline
from pretrain.parallel.mesh import destroy
from pretrain.train.trainer import Trainer

# The most receive-info entries (each a chunk's buffers) one stage held at once, this run.
RECV_PEAK = {"entries": 0}
_made = pipeline._MadeOnUse.__missing__


def _count_made(self, chunk):
    value = _made(self, chunk)
    RECV_PEAK["entries"] = max(RECV_PEAK["entries"], len(self))
    return value


pipeline._MadeOnUse.__missing__ = _count_made


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole model's parameters on rank 0 (empty elsewhere): each pipeline rank
    gathers its stages' shards, rank 0 collects the stages."""
    mine: dict[str, torch.Tensor] = {}
    for part in trainer.module.parts:
        sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        mine.update({k: v.detach().cpu().clone() for k, v in sd.items()})
    if not dist.is_initialized():
        return mine
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for sd in gathered:
        merged.update(sd)
    return merged


def pipeline_outputs(trainer: Trainer) -> int:
    """Bytes of microbatch outputs the pipeline schedule still holds after its step (with
    torch's default ``return_outputs=True`` the last stage keeps every microbatch's logits
    until the next step)."""
    schedule = getattr(trainer.module.strategy, "schedule", None)  # pipelines only
    if schedule is None:
        return 0
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return sum(local_bytes(o) for stage in stages for o in stage.output_chunks
               if torch.is_tensor(o))


def memory(trainer: Trainer) -> dict[str, int]:
    params = trainer.module.parallel.parameters()
    opt_bytes = sum(local_bytes(v) for s in trainer.module.optimizer.state.values()
                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    blocks = [p for part in trainer.module.parts for p in part.layers.parameters()]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": opt_bytes,
        "block_params": sum(local_bytes(p) for p in blocks),
        "pipeline_outputs": pipeline_outputs(trainer),
        "pipeline_recv_peak": RECV_PEAK["entries"],
    }


def linear_kinds(trainer: Trainer) -> dict[str, str]:
    """Each Linear's class and its weight's local tensor class (fp8: ``Float8Linear``, and
    ``WeightWithDynamicFloat8CastTensor`` when FSDP all-gathers it in fp8)."""
    kinds = {}
    for part in trainer.module.parts:
        for n, m in part.named_modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight.to_local() if isinstance(m.weight, DTensor) else m.weight
                kinds[n] = f"{type(m).__name__}/{type(w).__name__}"
    return kinds


def evaluate_with(trainer: Trainer, eval_batches: int) -> tuple[int, float]:
    """(batches evaluated, validation loss) with train.eval_batches=``eval_batches``."""
    evaluator = trainer.validation.evaluators[trainer.cfg.data.name]
    asked = evaluator.asked
    evaluator.asked = eval_batches
    try:
        return evaluator.batch_count(), trainer.evaluate()
    finally:
        evaluator.asked = asked


def run_layout(cfg: Config, out: Path, name: str, spec_eval_also: list[int]) -> None:
    RECV_PEAK["entries"] = 0  # this layout's own peak
    trainer = Trainer(cfg, out / name)
    trainer.setup()
    init = full_params(trainer)
    measured: dict[str, int] = {}

    def measure(optimizer, args, kwargs) -> None:  # before the step: grads and states exist
        measured.update(memory(trainer))

    hook = trainer.module.optimizer.register_step_pre_hook(measure)
    losses, norms, batches = [], [], []
    while not trainer.finished:  # the budget's steps (a batch ramp's: more of them)
        loss, norm = trainer.train_step()
        losses.append(loss)
        norms.append(norm)
        batches.append(trainer.batches.last)
    hook.remove()
    val = trainer.evaluate()
    extra_eval = [evaluate_with(trainer, n) for n in spec_eval_also]
    final = full_params(trainer)
    measured["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_rank = [measured]
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, measured)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"losses": losses, "grad_norms": norms, "batches": batches, "val_loss": val,
                    "val_batches": trainer.validation.batch_count(), "extra_eval": extra_eval,
                    "init": init,
                    "final": final, "memory": per_rank, "layout": trainer.layout.as_dict(),
                    "linears": linear_kinds(trainer)},
                   out / f"{name}.pt")
    # Its read-ahead thread, checkpoint worker and hooks go now, not at interpreter
    # shutdown; the process group stays for the next layout (main leaves it).
    trainer.close(leave_group=False)


def main() -> None:
    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    for name, cfg in spec["configs"].items():
        run_layout(cfg, out, name, spec["eval_also"])
        if dist.is_initialized():
            dist.barrier()
    # The groups, meshes and DTensor caches freed while the interpreter can still run
    # their gloo threads' last decrefs (mesh.destroy; trainer.run does the same). Left to
    # interpreter shutdown, a rank of a 4-rank world aborted after its results were written
    # ("terminate called without an active exception", exit -6).
    destroy()
    gc.collect()


if __name__ == "__main__":
    main()
