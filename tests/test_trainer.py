"""The training step in-process: gradient accumulation reaches the same update as one batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pretrain.train.evaluation import Evaluator
from pretrain.train.step_strategy import strategy_class
from pretrain.train.trainer import Trainer


def nano_trainer(compose, prepared, run_dir, micro_batch: int, extra: tuple = ()) -> Trainer:
    cfg = compose([
        "model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "model.attention=eager", "data.name=tinytext", f"data.root={prepared.parent}",
        "data.auto_prepare=false", "data.tokenizer_vocab_size=300",
        "train.global_batch_size=8",
        f"parallel.micro_batch_size={micro_batch}", "budget=steps", "budget.steps=3",
        "schedule.warmup_steps=1", "logging=quiet", "train.eval_batches=2", *extra,
    ])
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    return trainer


def test_grad_accumulation_matches_one_big_batch(compose, prepared, tmp_path):
    one = nano_trainer(compose, prepared, tmp_path / "one", micro_batch=8)
    accum = nano_trainer(compose, prepared, tmp_path / "accum", micro_batch=2)
    assert (one.layout.microbatches, accum.layout.microbatches) == (1, 4)
    assert one.plan["layout"]["grad_accum"] == 1 and accum.plan["layout"]["grad_accum"] == 4
    initial_one = [(n, p.detach().clone()) for n, p in one.module.model.named_parameters()]
    initial_accum = [p.detach().clone() for p in accum.module.model.parameters()]
    for _ in range(3):
        loss_a, gnorm_a = one.train_step()
        loss_b, gnorm_b = accum.train_step()
        assert loss_a == pytest.approx(loss_b, abs=1e-5)
        assert gnorm_a == pytest.approx(gnorm_b, rel=1e-4)
    assert one.samples_seen == accum.samples_seen == 24
    # The two differ only in summation order (~1e-7 relative in each gradient). Adam
    # normalises every coordinate's step, so a coordinate whose gradient nearly cancels
    # keeps rounding noise of its own size and may move a visible fraction of a step: each
    # coordinate within a quarter of one step, each tensor's update within 1e-3 relative
    # (a wrong accumulation moves a whole update by O(1)); see test_parallel_layouts.py.
    # The key bias is left out of the update check: its true gradient is exactly zero (a
    # shift of every score of a query, which softmax ignores), so its update is pure noise.
    lr = one.plan["lr"]
    for pa, pb in zip(one.module.model.parameters(), accum.module.model.parameters(), strict=True):
        assert (pa - pb).abs().max().item() <= lr / 4
    for (name, a0), b0, pa, pb in zip(initial_one, initial_accum, one.module.model.parameters(),
                                      accum.module.model.parameters(), strict=True):
        if name.endswith("attn.wk.bias"):
            continue
        update = pa.detach() - a0
        assert (pb.detach() - b0 - update).norm() <= 1e-3 * update.norm() + 1e-12, name


def test_same_seed_same_initial_model_and_eval(compose, prepared, tmp_path):
    a = nano_trainer(compose, prepared, tmp_path / "a", micro_batch=8)
    b = nano_trainer(compose, prepared, tmp_path / "b", micro_batch=8)
    params_a, params_b = list(a.module.model.parameters()), list(b.module.model.parameters())
    # nano, tied: token and position tables, 2 x 16 block tensors, final norm (2)
    assert len(params_a) == len(params_b) == 2 + 2 * 16 + 2
    for pa, pb in zip(params_a, params_b, strict=True):
        assert torch.equal(pa, pb)
    assert a.evaluate() == b.evaluate()


def test_nonfinite_steps_are_skipped_then_stop_the_run(compose, prepared, tmp_path):
    trainer = nano_trainer(compose, prepared, tmp_path / "nan", micro_batch=8)
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.module.model.parameters()]
    real = trainer.module.strategy.forward_backward

    def poisoned(x, y, measure=False):  # a forward that overflowed: NaN loss and NaN gradients
        loss, small = real(x, y, measure)
        for p in trainer.module.model.parameters():
            p.grad.fill_(float("nan"))
        return loss * float("nan"), small

    trainer.module.strategy.forward_backward = poisoned
    limit = trainer.cfg.train.max_nonfinite_steps
    for i in range(limit - 1):
        loss, _ = trainer.train_step()
        assert loss != loss  # NaN, reported as such
        assert trainer.module.skipped_steps == trainer.module.nonfinite_in_a_row == i + 1
    for p, q in zip(trainer.module.model.parameters(), before, strict=True):
        assert torch.equal(p, q)  # no update happened
    assert trainer.step == limit  # the steps (and their data) were consumed
    with pytest.raises(FloatingPointError, match="train.max_nonfinite_steps"):
        trainer.train_step()
    trainer.module.strategy.forward_backward = real
    trainer.module.nonfinite_in_a_row = 0
    trainer.train_step()
    assert trainer.module.nonfinite_in_a_row == 0
    assert any(not torch.equal(p, q) for p, q in zip(trainer.module.model.parameters(), before,
                                                     strict=True))


def test_load_weights_only_starts_a_new_run(compose, prepared, tmp_path):
    src = nano_trainer(compose, prepared, tmp_path / "src", micro_batch=8)
    src.train_step()
    src.save_checkpoint(block=True)
    cfg = compose([
        "model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "model.attention=eager", "data.name=tinytext", f"data.root={prepared.parent}",
        "data.auto_prepare=false", "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
        "parallel.micro_batch_size=8", "budget=steps", "budget.steps=3",
        "schedule.warmup_steps=1", "logging=quiet", "train.eval_batches=2",
        f"checkpoint.load_weights_only={tmp_path / 'src'}",
    ])
    new = Trainer(cfg, tmp_path / "new")
    new.setup()
    assert new.step == 0 and new.samples_seen == 0  # new schedule, new data position
    assert not new.module.optimizer.state  # new optimizer
    for p, q in zip(new.module.model.parameters(), src.module.model.parameters(), strict=True):
        assert torch.equal(p, q)
    bad = compose([*cfg_overrides_with(cfg, "model.n_layer=3")])
    with pytest.raises(Exception, match=r"model\.n_layer=3 \(checkpoint: 2\)"):
        Trainer(bad, tmp_path / "bad").setup()


def cfg_overrides_with(cfg, extra: str) -> list[str]:
    return [
        "model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "data.name=tinytext", f"data.root={cfg.data.root}", "data.auto_prepare=false",
        "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
        "parallel.micro_batch_size=8", "budget=steps", "budget.steps=3", "logging=quiet",
        f"checkpoint.load_weights_only={cfg.checkpoint.load_weights_only}", extra,
    ]


def eval_plan(eval_batches: int, dp: int, microbatches: int, pipeline: bool,
              windows: int = 10_000, micro_batch: int = 1) -> tuple[Evaluator, list[list]]:
    """The evaluator of rank 0, with the evaluation sizes of the step strategy this layout
    runs, and the (batch, weight) pairs each DP rank evaluates."""
    layout = SimpleNamespace(dp=dp, microbatches=microbatches, pp=2 if pipeline else 1)
    chunk, per_round = strategy_class(layout).eval_sizes(layout)
    module = SimpleNamespace(eval_chunk=chunk, eval_round=per_round)
    val = SimpleNamespace(n_windows=windows, seq_len=32)
    evaluators = [Evaluator(val, module, eval_batches=eval_batches,
                            micro_batch_size=micro_batch, dp=dp, dp_rank=rank,
                            device=torch.device("cpu")) for rank in range(dp)]
    return evaluators[0], [e.assignment() for e in evaluators]


def counted(work: list[list]) -> list[int]:
    return sorted(i for rank in work for i, w in rank if w)


def test_pipeline_eval_counts_every_computed_batch():
    # gpt3-175b: eval_batches=20, dp 8, 192 microbatches: one pipeline step is 1,536 batches
    t, work = eval_plan(20, dp=8, microbatches=192, pipeline=True)
    assert t.batch_count() == 1536
    assert all(len(rank) == 192 and all(w == 1.0 for _, w in rank) for rank in work)
    assert counted(work) == list(range(1536))  # every computed batch distinct, each once


def test_eval_without_pipeline_is_unchanged():
    t, work = eval_plan(3, dp=2, microbatches=4, pipeline=False)
    assert t.batch_count() == 3
    assert work == [[(0, 1.0), (2, 1.0)], [(1, 1.0), (0, 0.0)]]  # rank 1 pads, weight 0


def test_eval_capped_at_the_validation_split(caplog):
    # 11 windows of 2 sequences: 5 distinct batches, fewer than one pipeline step of 8
    t, work = eval_plan(3, dp=2, microbatches=4, pipeline=True, windows=11, micro_batch=2)
    assert t.batch_count() == 5
    assert counted(work) == list(range(5))
    assert all(len(rank) == 4 for rank in work)  # still whole pipeline steps, padded
    with caplog.at_level("WARNING", logger="pretrain"):
        t.describe()
    assert "each evaluation averages those 5" in caplog.text
    assert "train.eval_batches=3, 8 in whole pipeline steps" in caplog.text


def test_a_fused_optimizer_skips_nonfinite_steps_on_the_device(compose, prepared, tmp_path):
    """With a fused AdamW (the GPU default) the skip is decided on the device, no host sync:
    parameters and optimizer state (moments and step counts) stay exactly as they were,
    and the counts are read, and warned about, at the next step that syncs anyway."""
    trainer = nano_trainer(compose, prepared, tmp_path / "fused", micro_batch=8,
                           extra=("optim.fused=true",))
    assert trainer.module.optimizer.defaults["fused"]
    trainer.train_step_local()
    params = [p.detach().clone() for p in trainer.module.model.parameters()]
    state = {(i, k): v.clone() for i, p in enumerate(trainer.module.model.parameters())
             for k, v in trainer.module.optimizer.state[p].items()}
    real = trainer.module.strategy.forward_backward

    def poisoned(x, y, measure=False):
        loss, small = real(x, y, measure)
        next(iter(trainer.module.model.parameters())).grad.view(-1)[0] = float("inf")
        return loss, small

    trainer.module.strategy.forward_backward = poisoned
    syncs = []
    orig_item = torch.Tensor.item
    torch.Tensor.item = lambda t: syncs.append(1) or orig_item(t)
    try:
        _, norm = trainer.train_step_local()
    finally:
        torch.Tensor.item = orig_item
    assert syncs == [] and not torch.isfinite(norm)
    assert trainer.module.skipped_steps == 0  # not read yet
    for p, q in zip(trainer.module.model.parameters(), params, strict=True):
        assert torch.equal(p, q)
    after = {(i, k): v for i, p in enumerate(trainer.module.model.parameters())
             for k, v in trainer.module.optimizer.state[p].items()}
    assert all(torch.equal(after[k], v) for k, v in state.items())
    trainer._check_nonfinite()
    assert trainer.module.skipped_steps == trainer.module.nonfinite_in_a_row == 1
    trainer.module.strategy.forward_backward = real
    trainer.train_step_local()
    trainer._check_nonfinite()
    assert trainer.module.skipped_steps == 1 and trainer.module.nonfinite_in_a_row == 0
    assert any(not torch.equal(p, q) for p, q in zip(trainer.module.model.parameters(), params,
                                                     strict=True))
