"""GC control in the training loop (src/pretrain/train/services/garbage.py)."""

from __future__ import annotations

import gc

from pretrain.train.services.garbage import GarbageCollection


def test_gc_off_during_training_collected_every_interval_restored_after(monkeypatch):
    assert gc.isenabled()
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda gen=2: calls.append(gen) or real(gen))
    collector = GarbageCollection(3)
    assert not gc.isenabled()
    for step in range(1, 10):
        collector.step(step)
    assert calls == [1, 1, 1, 1]  # once at start, then after steps 3, 6, 9
    collector.close()
    assert gc.isenabled()


def test_interval_zero_leaves_automatic_gc_alone():
    collector = GarbageCollection(0)
    assert gc.isenabled()
    collector.step(50)
    collector.close()
    assert gc.isenabled()
