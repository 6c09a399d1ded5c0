"""What one training step costs beyond the model's own work: a CPU proxy for a GPU's launches.

On a GPU a small model's step is bound by the host: every aten op the step dispatches is at
least one kernel launch (measured on an H100 for GPT-2 124M: 15,162 launches and 1.00 s of
host time against 0.49 s of GPU work for two steps, when one process still went through
FSDP2 over a group of one; ../shared/gpu/README.md). Here the ops one eager training step
dispatches are counted (a ``TorchDispatchMode``: what reaches the kernels, after autograd
and autocast) for the trainer's step (``Trainer.train_step_local``, a non-logging step of
``fit``) and for nanoGPT's loop over the same model (forward, ``F.cross_entropy``,
backward, clip, AdamW step: ``tools/bench.plain_loop``), at the gpt2-124m shape with a small
batch and 2 micro batches. The trainer may add the bookkeeping a real run needs (the loss
sum, the skip decision, the LR schedule), not copies of the weights or the gradients.

The count depends on the model's structure (layers, norms, attention, tied head), not on its
widths: both precisions run gpt2-124m's 12-layer structure at width 96 and a 256-token
vocabulary (the same counts as the published widths, docs/benchmarks.md; those took 20 s
of CPU a run, and the AVX2 CPU kind emulates bf16 matmuls at ~0.3 GFLOP/s).
"""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import MARKOV_DATA, compose_config, one_thread
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.model.gpt import build_model
from pretrain.tools.bench import plain_loop
from pretrain.train.trainer import Trainer

MAX_RATIO = 1.15  # issue 35: trainer ops per step / plain loop ops per step
MICRO, SEQ, ACCUM = 1, 32, 2


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def trainer_for(root, tmp_path, precision: str, narrow: bool = True) -> Trainer:
    cfg = compose_config(
        [
            "model=gpt2-124m",
            f"model.seq_len={SEQ}",
            *(["model.d_model=96", "model.vocab_size=256"] if narrow else []),
            *MARKOV_DATA,
            f"data.root={root}",
            "train.device=cpu",
            f"precision={precision}",
            "budget=steps",
            "budget.steps=10",
            f"parallel.micro_batch_size={MICRO}",
            f"train.global_batch_size={MICRO * ACCUM}",
            "train.eval_interval=1000",
            "train.sample_tokens=0",
            "logging=quiet",
            "logging.log_interval=1000",
            "train.noise_scale=false",
            f"runs_dir={tmp_path}",
        ]
    )
    trainer = Trainer(cfg, tmp_path / precision)
    trainer.setup()
    return trainer


def count_steps(trainer: Trainer) -> tuple[Counter, Counter]:
    """(ops of the trainer's second step, ops of the plain loop's second step): the first
    of each creates the optimizer state."""
    trainer.train_step_local()
    with OpCounter() as mine:
        trainer.train_step_local()
    x, y = trainer._local_batch()
    batches = list(zip(x.chunk(ACCUM), y.chunk(ACCUM), strict=True))
    # the plain loop's own model: the same config and weights, no wrapper of any kind
    model = build_model(trainer.cfg, trainer.device, trainer.decision.attention,
                        trainer.cfg.train.seed)
    step = plain_loop(model, trainer.device, trainer.policy.compute_dtype)
    step(batches)
    with OpCounter() as plain:
        step(batches)
    return mine.ops, plain.ops


def report(mine: Counter, plain: Counter) -> str:
    extra = {k: mine[k] - plain.get(k, 0) for k in mine if mine[k] > plain.get(k, 0)}
    top = sorted(extra.items(), key=lambda kv: -kv[1])[:8]
    copies = {k: (mine[k], plain[k]) for k in ("aten._to_copy", "aten.copy_")}
    return (f"trainer {sum(mine.values())} ops, plain loop {sum(plain.values())} {copies} "
            f"({sum(mine.values()) / sum(plain.values()):.3f}x); most added: {top}")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_dispatches_what_the_plain_loop_does(markov_root, tmp_path, precision):
    with one_thread():
        trainer = trainer_for(markov_root, tmp_path, precision)
        try:
            mine, plain = count_steps(trainer)
        finally:
            trainer.close()
    print(report(mine, plain))
    assert sum(mine.values()) <= MAX_RATIO * sum(plain.values()), report(mine, plain)
    # no weight or gradient copies beyond the plain loop's (a scalar or two: the norm, the
    # loss sum): autocast casts each weight once a step (the plain loop once a micro batch),
    # and nothing is copied into a wrapper's buffers
    assert mine["aten._to_copy"] <= plain["aten._to_copy"] + 2, report(mine, plain)
    assert mine["aten.copy_"] <= plain["aten.copy_"] + 2, report(mine, plain)
