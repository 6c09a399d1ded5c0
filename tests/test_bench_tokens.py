"""tools/bench.py counts the tokens the trainer's steps took. Under a batch ramp (gpt3-1.3b's
recipe ramps as Brown et al. did) the first steps take part of the global batch; counted
as the full batch, the H200's 1.3B row read 123,359 tokens/s and an MFU of 1.13, above the
card's peak (docs/benchmarks.md, 2026-11-28)."""

from __future__ import annotations

import pytest
from helpers import MARKOV_DATA

from pretrain.tools.bench import measure

TINY = [*MARKOV_DATA, "model=tiny", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "model.seq_len=16", "model.vocab_size=256", "precision=fp32", "train.device=cpu",
        "budget=steps", "budget.steps=100", "train.noise_scale=false", "train.global_batch_size=8",
        "parallel.micro_batch_size=2"]


@pytest.mark.parametrize(("ramp", "taken"), [
    # 32 sequences of 16 tokens taken by the start: the ramp's first steps take 4 of 8
    (["batch_ramp=tokens", "batch_ramp.start_tokens=64", "batch_ramp.ramp_tokens=100000"], 4),
    (["batch_ramp=none"], 8),
])
def test_the_bench_counts_the_batch_the_steps_took(markov_root, ramp, taken):
    row = measure("trainer", [*TINY, f"data.root={markov_root}", *ramp], steps=2, warmup=1)
    assert row["global_batch"] == 8
    assert row["batch_taken"] == taken, row
    # tokens/s is the taken tokens over the time, not the full batch's (2x under the ramp);
    # step_s is rounded to 0.1 ms, up to 1% of a 5-ms step (CI read 63.35 for 64 once)
    tokens_a_step = row["tokens_per_s"] * row["step_s"]
    rounding = row["tokens_per_s"] * 5e-5 + 0.05 * row["step_s"]
    assert tokens_a_step == pytest.approx(taken * 16, abs=1.01 * rounding + 1e-9), row
    assert abs(tokens_a_step - 2 * taken * 16) > 0.25 * taken * 16
