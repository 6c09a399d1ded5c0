"""Batches and weights on one device, on a machine that has a GPU or not.

On a GPU machine one process of ``precision=fp32 parallel.offload=params`` kept its weights on
the host (where offloading puts them) without the FSDP2 wrapper that brings them to the GPU
for each block, so its batches (on the GPU) met CPU weights: "index is on cuda:0, different
from other tensors on cpu". On a CPU the same run trained, silently without the offload it
asked for. These run on the CPU; where "a GPU exists" is what matters, it is imitated."""

from __future__ import annotations

import pytest
import torch
from helpers import MARKOV_DATA
from torch.distributed.tensor import DTensor

from pretrain.decision.resolve import resolve_run
from pretrain.parallel.apply import parallelize_gpt
from pretrain.parallel.layout import resolve_layout
from pretrain.precision.policy import resolve_policy
from pretrain.train.trainer import Trainer


def nano(compose, markov_root, *extra: str):
    return compose(["model=nano", *MARKOV_DATA, f"data.root={markov_root}", "budget=steps",
                    "budget.steps=2", "train.global_batch_size=4", "parallel.micro_batch_size=4",
                    "train.eval_interval=1000", "train.sample_tokens=0", "logging=quiet",
                    *extra])


def test_one_offloaded_process_joins_a_group_of_one_and_wraps_fsdp(compose, markov_root,
                                                                  tmp_path):
    cfg = nano(compose, markov_root, "precision=fp32", "parallel.offload=params",
               "train.device=cpu")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.setup()
        assert trainer.place.mesh is not None  # FSDP2 needs one, for one process too
        params = trainer.module.parallel.parameters()
        assert params and all(isinstance(p, DTensor) for p in params)  # FSDP2 manages them
        assert trainer.module.parallel.param_device == torch.device("cpu")
        for _ in range(2):
            loss, _ = trainer.train_step()
            assert torch.isfinite(torch.as_tensor(loss))
    finally:
        trainer.close()


def test_a_layout_that_needs_fsdp_is_refused_without_a_mesh(compose):
    cfg = compose(["model=nano", "precision=fp32", "parallel.offload=params"])
    with pytest.raises(ValueError, match="needs FSDP2"):
        parallelize_gpt(cfg, resolve_layout(cfg, 1), None, torch.device("cpu"),
                        resolve_policy(cfg.precision, torch.device("cpu")), "sdpa")


@pytest.fixture
def cuda_present(monkeypatch):
    """torch says a GPU is usable, and any step that touched it fails the test (on this
    machine there is none to touch: a real call could not run anyway)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # torch's own optimizers ask, whenever CUDA is available, whether a CUDA graph is being
    # captured: harmless on a GPU box, a driver error on a CUDA build without a GPU
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def touched(*args, **kwargs):
        raise AssertionError("a train.device=cpu run touched CUDA")

    for name in ("set_device", "synchronize", "get_device_name", "get_device_capability",
                 "get_device_properties", "max_memory_allocated", "max_memory_reserved",
                 "reset_peak_memory_stats", "current_device", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, touched)
    monkeypatch.setattr(torch.Tensor, "pin_memory", touched)  # a CUDA host allocation


def test_auto_picks_the_gpu_when_one_exists(compose, cuda_present):
    """Why tests that mean the CPU say train.device=cpu (tests/helpers.compose_config)."""
    from pretrain.hardware.device import pick_device

    assert pick_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("extra", [["precision=fp32"], ["precision=bf16"],
                                   ["precision=fp32", "parallel.offload=params"]])
def test_train_device_cpu_on_a_gpu_machine_keeps_everything_on_the_cpu(
        compose, markov_root, tmp_path, cuda_present, extra):
    """A user's train.device=cpu where a GPU exists: the plan, the weights, the optimizer
    state and every batch on the CPU (gloo for the group of one), no CUDA call."""
    cfg = nano(compose, markov_root, "train.device=cpu", *extra)
    assert resolve_run(cfg).plan["device"] == "cpu"
    trainer = Trainer(cfg, tmp_path / "run")
    seen = []
    try:
        trainer.setup()
        assert trainer.device == torch.device("cpu")
        real = trainer.module.step

        def step(x, y, *args, **kwargs):
            seen.append((x.device, y.device))
            return real(x, y, *args, **kwargs)

        trainer.module.step = step
        for _ in range(2):
            trainer.train_step()
        devices = {t.device for p in trainer.module.parallel.parameters()
                   for t in (p, *trainer.module.optimizer.state[p].values())
                   if isinstance(t, torch.Tensor)}
        assert devices == {torch.device("cpu")}
        assert seen and set(seen) == {(torch.device("cpu"),) * 2}
    finally:
        trainer.close()
