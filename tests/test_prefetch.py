"""The prefetching loader (src/pretrain/data/prefetch.py) gives exactly the plain loader's
batches, resumes from any position, and leaves no thread behind."""

from __future__ import annotations

import threading

import torch

from pretrain.data.loader import TokenWindows
from pretrain.data.prefetch import Prefetcher


def test_prefetched_batches_are_the_loaders_and_resume_exactly(prepared):
    data = TokenWindows(prepared, "train", 16, seed=3)
    count, stride, dp_rank = 2, 8, 1  # rank 1 of dp=4: samples 2-3 of every batch of 8
    plain = [data.batch(step * stride + dp_rank * count, count) for step in range(12)]
    loader = Prefetcher(data, count, stride, pin=False, depth=3)
    try:
        for step in range(6):
            x, y = loader.get(step * stride + dp_rank * count)
            assert x.is_contiguous() and y.is_contiguous()
            assert torch.equal(x, plain[step][0]) and torch.equal(y, plain[step][1])
        # a resume (or any jump) from step 9: the thread restarts there
        for step in (9, 10, 11):
            x, y = loader.get(step * stride + dp_rank * count)
            assert torch.equal(x, plain[step][0]) and torch.equal(y, plain[step][1])
        thread = loader._thread
    finally:
        loader.close()
    assert thread is not None and not thread.is_alive()


def test_a_read_error_reaches_the_caller(prepared):
    data = TokenWindows(prepared, "train", 16)

    def broken(start, count):
        raise OSError("shard unreadable")

    data.batch = broken
    loader = Prefetcher(data, 2, 8, pin=False)
    try:
        try:
            loader.get(0)
        except OSError as e:
            assert "shard unreadable" in str(e)
        else:
            raise AssertionError("no error")
    finally:
        loader.close()


def test_no_prefetch_thread_outlives_a_run(compose, prepared, tmp_path):
    from pretrain.train.trainer import run

    cfg = compose([
        "model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "data.name=tinytext", f"data.root={prepared.parent}", "data.auto_prepare=false",
        "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
        "parallel.micro_batch_size=8", "budget=steps", "budget.steps=3", "logging=quiet",
        "train.eval_batches=1", "train.sample_tokens=0", "logging.wandb=disabled"])
    before = {t for t in threading.enumerate() if t.name == "pretrain-prefetch"}
    result = run(cfg, tmp_path / "run")
    assert result["steps"] == 3
    assert {t for t in threading.enumerate() if t.name == "pretrain-prefetch"} <= before
