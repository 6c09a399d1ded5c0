"""Initial weights are a pure function of (seed, name, global shape): a shard's values are
the same elements' values in one process, whichever layout, rank or tiling produced them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.config.compose import compose_config
from pretrain.model.gpt import GPT, build_model
from pretrain.model.initialization import TILE, Init, fill_normal_, init_parameters

PROBE = Path(__file__).with_name("init_probe.py")
NANO = ["model=nano", "model.n_layer=4", "model.vocab_size=300", "precision=fp32",
        "train.global_batch_size=32"]


def full_normal(shape: tuple[int, ...], seed: int = 0, key: str = "w") -> torch.Tensor:
    out = torch.empty(shape)
    fill_normal_(out, (0,) * len(shape), shape, 1.0, seed, key)
    return out


@pytest.mark.parametrize("offsets,sizes", [
    ((0, 0), (1, 1)),
    ((TILE[0] - 3, TILE[1] - 5), (7, 11)),  # across a tile corner
    ((100, 900), (200, 700)),  # several tiles, ragged on both sides
    ((0, 1500), (300, 548)),  # up to the last, partial tile column
])
def test_a_region_is_the_slice_of_the_whole(offsets, sizes):
    shape = (300, 2048)
    whole = full_normal(shape)
    part = torch.empty(sizes)
    fill_normal_(part, offsets, shape, 1.0, 0, "w")
    expect = whole[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]]
    assert torch.equal(part, expect)


def test_one_dimensional_regions_and_low_precision_targets():
    whole = full_normal((5000,))
    part = torch.empty(1234, dtype=torch.bfloat16)
    fill_normal_(part, (2000,), (5000,), 1.0, 0, "w")
    assert torch.equal(part, whole[2000:3234].to(torch.bfloat16))


def test_values_depend_on_seed_name_and_shape_only():
    a = full_normal((64, 64), seed=1, key="a")
    assert torch.equal(a, full_normal((64, 64), seed=1, key="a"))
    assert not torch.equal(a, full_normal((64, 64), seed=2, key="a"))
    assert not torch.equal(a, full_normal((64, 64), seed=1, key="b"))
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(a, full_normal((64, 64), seed=1, key="a"))
    big = full_normal((300, 3000))  # many tiles: the draws are standard normal, not repeated
    assert abs(big.mean().item()) < 0.01 and abs(big.std().item() - 1) < 0.01
    r, c = TILE
    tiles = [big[:r, :c], big[r:2 * r, :c], big[:r, c:2 * c]]  # neighbours are independent
    for other in tiles[1:]:
        corr = torch.corrcoef(torch.stack([tiles[0].flatten(), other.flatten()]))[0, 1]
        assert abs(corr.item()) < 0.02


def test_unknown_rule_is_an_error():
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="unknown initialisation 'uniform'"):
        init_parameters(layer, 0, lambda name: Init("uniform"))


def test_gpt_starts_the_same_from_the_same_seed_and_ties_its_head():
    cfg = compose_config(NANO)
    a = build_model(cfg, torch.device("cpu"), "sdpa", 7).state_dict()
    b = build_model(cfg, torch.device("cpu"), "sdpa", 7).state_dict()
    c = build_model(cfg, torch.device("cpu"), "sdpa", 8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq.weight"], c["layers.0.attn.wq.weight"])
    assert torch.equal(a["lm_head.weight"], a["tok_emb.weight"])
    n, std = cfg.model.n_layer, cfg.model.init_std
    wo = a["layers.0.attn.wo.weight"]
    assert wo.std().item() == pytest.approx(std / (2 * n) ** 0.5, rel=0.05)
    assert torch.equal(
        a["layers.1.mlp_norm.weight"], torch.ones_like(a["layers.1.mlp_norm.weight"])
    )


LAYOUTS = {  # name: (world, rank, overrides)
    "tp2+SP x zero3 dp2, rank 3": (4, 3, ["parallel.tp=2", "parallel.dp=2",
                                           "parallel.sequence_parallel=true",
                                           "parallel.dp_mode=zero3"]),
    "zbv pp2, rank 1 (tied head on the embedding's rank)": (
        2, 1, ["parallel.pp=2", "parallel.dp=1", "parallel.virtual_stages=2",
               "parallel.pp_schedule=zbv"]),
    "tp2 x pp2 x zero2 dp2, rank 6, untied swiglu rope": (
        8, 6, ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=zero2",
               "model.tie_embeddings=false", "model.pos_emb=rope", "model.mlp=swiglu",
               "model.norm=rmsnorm"]),
    "zero3 dp8 (uneven shards of a 300-row vocabulary), rank 7": (
        8, 7, ["parallel.dp=8", "parallel.dp_mode=zero3", "parallel.micro_batch_size=4"]),
}


def test_every_layout_shard_equals_the_one_process_weights():
    specs = [{"overrides": [*NANO, *ov], "world": w, "rank": r} for w, r, ov in LAYOUTS.values()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(specs)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=PROBE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(LAYOUTS), proc.stdout + proc.stderr[-3000:]
    for name, got in zip(LAYOUTS, results, strict=True):
        assert "error" not in got, (name, got)
        assert got["wrong"] == [], (name, got)
        assert 0 < got["elements"] < got["full_elements"], (name, got)  # a shard, not all


def test_init_under_a_device_context_draws_the_same_weights():
    """Issue 49: ``init_weights()`` inside ``with torch.device("cuda")`` refused the CPU
    generator ("Expected a 'cuda' device type for generator"). The same mismatch on the CPU:
    a model built and initialised inside ``with torch.device("meta")``, materialised, then
    initialised again inside the meta context (before the fix: the tiles were drawn on the
    meta device, "Cannot copy out of meta tensor"): every weight equals a CPU build's."""
    cfg = compose_config(NANO)
    with torch.device("meta"):
        model = GPT(cfg.model)
        model.init_weights(0)  # meta parameters: nothing to write, and no error
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.device("meta"):  # the context's device differs from the generator's
        model.init_weights(0)
    reference = build_model(cfg, torch.device("cpu"), "sdpa", 0)
    got, expect = model.state_dict(), reference.state_dict()
    assert got.keys() == expect.keys()
    for name, value in expect.items():
        assert torch.equal(got[name], value), name
