"""CheckpointManager: atomic completion, crash safety, retention in the background, one
reused stager for async saves, round trip; on two ranks, rank 0 decides for both."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from two_ranks import blind_to_checkpoints, run_on_two_ranks

from pretrain.checkpoint import manager as manager_module
from pretrain.checkpoint.folder import CheckpointError, complete_checkpoints, resolve_checkpoint
from pretrain.checkpoint.manager import CheckpointManager, stager_reusable
from pretrain.checkpoint.model_state import ModelOptimizer
from pretrain.config.schema import CheckpointConfig, ModelConfig
from pretrain.model.gpt import GPT

CFG = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64)


class Progress:
    """A minimal Stateful, as the trainer's own progress is."""

    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def trained_pair(seed: int):
    torch.manual_seed(seed)
    model = GPT(CFG)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 16))
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def save(mgr: CheckpointManager, model, opt, step: int, block: bool = False):
    mgr.save(step, {"model_optim": ModelOptimizer(model, opt), "train": Progress(step)},
             {"step": step}, block=block)
    mgr.wait()


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_is_exact(tmp_path, async_save):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, async_save=async_save))
    save(mgr, model, opt, 7)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [7]
    meta = json.loads((tmp_path / "step_0000007" / "meta.json").read_text())
    assert meta["step"] == 7 and ".metadata" in meta["files"]

    other, other_opt = trained_pair(1)
    progress = Progress()
    CheckpointManager.load(mgr.latest(), {"model_optim": ModelOptimizer(other, other_opt),
                                          "train": progress})
    assert progress.step == 7
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert other.lm_head.weight is other.tok_emb.weight  # loading keeps the tie
    sa, sb = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])


def test_cut_short_and_corrupt_checkpoints_are_skipped_not_deleted(tmp_path, caplog):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, keep_last=5))
    save(mgr, model, opt, 1)
    save(mgr, model, opt, 2)
    # A save cut short: its temporary directory is left behind.
    (tmp_path / "step_0000003.tmp").mkdir()
    (tmp_path / "step_0000003.tmp" / "__0_0.distcp").write_bytes(b"partial")
    # A complete-looking directory whose shard was truncated afterwards.
    shard = next((tmp_path / "step_0000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        assert mgr.latest() == tmp_path / "step_0000001"
    assert "step_0000003.tmp" in caplog.text and "step_0000002" in caplog.text
    assert (tmp_path / "step_0000003.tmp").exists() and (tmp_path / "step_0000002").exists()
    with pytest.raises(CheckpointError, match="step_0000002"):
        resolve_checkpoint(tmp_path / "step_0000002")


def test_retention_keeps_last_k_and_every_m(tmp_path):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, keep_last=2, keep_every=4))
    for step in range(1, 10):
        save(mgr, model, opt, step, block=True)
    mgr.close()  # deletions run in the background: wait for them
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000004", "step_0000008", "step_0000009"]  # no .deleting leftovers


def test_retention_never_deletes_the_newest(tmp_path):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, keep_last=0))
    save(mgr, model, opt, 1)
    save(mgr, model, opt, 2)
    mgr.close()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]


def test_existing_step_is_not_overwritten(tmp_path):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True))
    save(mgr, model, opt, 5)
    before = {f.name: f.read_bytes() for f in (tmp_path / "step_0000005").iterdir()}
    other, other_opt = trained_pair(1)
    save(mgr, other, other_opt, 5)
    after = {f.name: f.read_bytes() for f in (tmp_path / "step_0000005").iterdir()}
    assert before == after


def test_resolve_checkpoint_finds_the_newest_in_a_run_dir(tmp_path):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path / "checkpoints", CheckpointConfig(enabled=True))
    save(mgr, model, opt, 3)
    save(mgr, model, opt, 6)
    assert resolve_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_0000006"
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="nowhere: no such path"):
        resolve_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"step_0000005: no such step folder; .* holds "
                                              r"complete checkpoints at steps \[3, 6\]"):
        resolve_checkpoint(tmp_path / "checkpoints" / "step_0000005")


def test_due_by_steps_and_by_minutes(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, interval_steps=5))
    assert [s for s in range(1, 12) if mgr.due(s)] == [5, 10]
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, interval_minutes=1.0))
    assert not mgr.due(1)
    mgr.last_save_time -= 61  # a minute and a second since the last save
    assert mgr.due(2)
    off = CheckpointManager(tmp_path, CheckpointConfig(enabled=False, interval_steps=1))
    assert not off.due(1)


def test_retention_never_deletes_the_only_complete_checkpoint(tmp_path):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, keep_last=1,
                                                       async_save=False))
    save(mgr, model, opt, 1)
    mgr.finish_deletions()  # the background pass after saving step 1 is over
    # A newer directory that is not a complete checkpoint: a shard went missing.
    newer = tmp_path / "step_0000002"
    shutil.copytree(tmp_path / "step_0000001", newer)
    next(newer.glob("*.distcp")).unlink()
    assert mgr.retain() == []
    assert (tmp_path / "step_0000001").exists() and newer.exists()
    mgr.close()


def test_retention_does_not_hold_up_saving_and_hides_what_it_deletes(tmp_path, monkeypatch):
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, keep_last=1,
                                                       async_save=False))
    save(mgr, model, opt, 1)
    deleting, release, deleted = threading.Event(), threading.Event(), threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):  # a shared filesystem deleting a big checkpoint
        deleting.set()
        release.wait(timeout=10)
        real_rmtree(path, *args, **kwargs)
        deleted.set()

    monkeypatch.setattr("pretrain.checkpoint.manager.shutil.rmtree", slow_rmtree)
    save(mgr, model, opt, 2)  # finalising step 2 condemns step 1
    assert not deleted.is_set()  # save returned while step 1 was not yet deleted
    assert deleting.wait(timeout=10)
    assert not (tmp_path / "step_0000001").exists()  # renamed out of sight first
    assert (tmp_path / "step_0000001.deleting").is_dir()
    assert mgr.latest() == tmp_path / "step_0000002"
    # Even with nothing newer left complete, the condemned checkpoint is never offered.
    shard = next((tmp_path / "step_0000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert mgr.latest() is None
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join(timeout=0.5)
    assert closer.is_alive()  # close() waits for the pending deletion
    release.set()
    closer.join(timeout=10)
    assert not closer.is_alive() and deleted.is_set()
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000002"]


def _two_async_saves(tmp_path, monkeypatch):
    """Save steps 1 and 2 asynchronously (a training step between); check each loads back
    bit-exactly. Returns the manager, the stagers async_save got and the tok_emb copy each
    stage made."""
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, keep_last=5))
    stagers, staged = [], []
    real_async_save = dcp.async_save

    def spy_async_save(state, **kwargs):
        stager = kwargs["async_stager"]
        stagers.append(stager)
        real_stage = stager.stage

        def spy_stage(state, **kwargs):
            out = real_stage(state, **kwargs)
            staged.append(out["model_optim"]["model"]["tok_emb.weight"])
            return out

        monkeypatch.setattr(stager, "stage", spy_stage)
        return real_async_save(state, **kwargs)

    monkeypatch.setattr(dcp, "async_save", spy_async_save)
    save(mgr, model, opt, 1)
    at_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean().backward()
    opt.step()
    save(mgr, model, opt, 2)

    for step, expected in ((1, at_step_1), (2, model.state_dict())):
        other, other_opt = trained_pair(1)
        CheckpointManager.load(tmp_path / f"step_{step:07d}",
                               {"model_optim": ModelOptimizer(other, other_opt),
                                "train": Progress()})
        for name, value in other.state_dict().items():
            assert torch.equal(value, expected[name]), (step, name)
    sa, sb = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    return mgr, stagers, staged, (model, opt)


def test_consecutive_async_saves_load_back_exactly_on_this_torch(tmp_path, monkeypatch):
    """On every supported torch. torch 2.11's DefaultStager is single-use (it empties its
    deep-copy table after one stage): reused, the second save raised KeyError: <class
    'type'>, and a cluster run stopped at its second periodic save."""
    mgr, stagers, staged, _ = _two_async_saves(tmp_path, monkeypatch)
    assert len(stagers) == 2 and None not in stagers
    assert (stagers[0] is stagers[1]) == stager_reusable()
    mgr.close()


def test_a_single_use_stager_gets_a_fresh_one_per_save(tmp_path, monkeypatch):
    """The path torch 2.11 takes, on whichever torch this is."""
    monkeypatch.setattr(manager_module, "STAGER_REUSABLE_FROM", "99.0")
    mgr, stagers, staged, _ = _two_async_saves(tmp_path, monkeypatch)
    assert mgr.stager is None and stagers[0] is not stagers[1]
    mgr.close()


@pytest.mark.skipif(not stager_reusable(), reason="this torch's DefaultStager is single-use")
def test_async_saves_reuse_one_stager_and_its_memory(tmp_path, monkeypatch):
    mgr, stagers, staged, (model, opt) = _two_async_saves(tmp_path, monkeypatch)
    assert stagers[0] is stagers[1] is mgr.stager
    # The second save copied into the first one's staging memory, not into fresh memory.
    assert staged[0].data_ptr() == staged[1].data_ptr()
    real_close, closed = mgr.stager.close, []
    monkeypatch.setattr(mgr.stager, "close", lambda: closed.append(1) or real_close())
    mgr.close()
    mgr.close()
    assert closed == [1]  # closed once, and a second close() is harmless
    with pytest.raises(CheckpointError, match="closed"):
        save(mgr, model, opt, 3)


# -- two ranks: rank 0 looks, both act on its answer -----------------------------------------

def _save_and_find_with_a_blind_rank_1(rank: int, folder: Path) -> dict[str, str]:
    """Rank 1 cannot see the checkpoint directories rank 0 sees. Alone it would resume from
    nothing and write step 3 again (entering a save collective that rank 0 skips)."""
    if rank == 1:
        blind_to_checkpoints()
    model, opt = trained_pair(0)
    mgr = CheckpointManager(folder, CheckpointConfig(enabled=True, keep_last=5))
    found = mgr.latest()
    for step in (3, 4):  # 3 exists: skipped by both; 4 is new: written by both
        mgr.save(step, {"model_optim": ModelOptimizer(model, opt), "train": Progress(step)},
                 {"step": step})
    mgr.close()
    return {"found": str(found), "after": str(mgr.latest())}


@pytest.mark.slow
def test_two_ranks_act_on_what_rank_0_sees(tmp_path):
    model, opt = trained_pair(0)
    folder = tmp_path / "checkpoints"
    save(CheckpointManager(folder, CheckpointConfig(enabled=True)), model, opt, 3)
    before = {f.name: f.read_bytes() for f in (folder / "step_0000003").iterdir()}
    got = run_on_two_ranks(_save_and_find_with_a_blind_rank_1, tmp_path / "store", folder)
    expected = {"found": str(folder / "step_0000003"), "after": str(folder / "step_0000004")}
    assert got == [("ok", expected), ("ok", expected)]
    assert [s for s, _ in complete_checkpoints(folder)] == [3, 4]
    assert before == {f.name: f.read_bytes() for f in (folder / "step_0000003").iterdir()}


def test_a_stale_step_directory_is_moved_aside_and_the_step_saved(tmp_path, caplog):
    """A corrupt step_N left behind (a crash, a bad disk) does not block saving step N: it
    is moved aside, named in a warning, and step N is saved complete."""
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True))
    stale = tmp_path / "step_0000004"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"left over")  # no .metadata, no meta.json
    with caplog.at_level("WARNING"):
        save(mgr, model, opt, 4)
    assert "step_0000004 was left incomplete or corrupt" in caplog.text
    assert mgr.latest() == tmp_path / "step_0000004"
    assert (tmp_path / "step_0000004.stale" / "__0_0.distcp").read_bytes() == b"left over"
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4]


@pytest.mark.parametrize(("error", "cause"), [
    (OSError(28, "No space left on device"), "no space left on the device"),
    (PermissionError(13, "Permission denied"), "the directory is read-only or not writable"),
    (RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 64"),
     r"RuntimeError: \[enforce fail"),
])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_names_its_cause_and_keeps_the_older_checkpoints(
        tmp_path, monkeypatch, error, cause, async_save):
    from pretrain.checkpoint import manager

    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, async_save=async_save))
    save(mgr, model, opt, 1)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(manager.dcp, "async_save" if async_save else "save", fail)
    with pytest.raises(CheckpointError, match=f"saving checkpoint step_0000002 in .* failed: "
                                              f"{cause}.*older checkpoints there are kept"):
        save(mgr, model, opt, 2)
    assert mgr.latest() == tmp_path / "step_0000001"


def refuse_writes(monkeypatch, folder: Path) -> None:
    """Every write under ``folder`` fails as on a read-only filesystem (EROFS), from now on.
    The write calls themselves fail: chmod does not stop root."""
    import errno

    def refusing(name):
        real = getattr(Path, name)

        def call(self, *args, **kwargs):
            mode = args[0] if name == "open" and args else kwargs.get("mode", "r")
            writes = name != "open" or any(c in str(mode) for c in "wax+")
            if writes and Path(self).resolve().is_relative_to(folder.resolve()):
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real(self, *args, **kwargs)
        return call

    for name in ("mkdir", "write_text", "write_bytes", "rename", "touch", "unlink", "open"):
        monkeypatch.setattr(Path, name, refusing(name))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_read_only_folder_fails_the_save_with_its_cause(tmp_path, monkeypatch, async_save):
    """The filesystem turns read-only: a blocking save fails making its step folder, an
    async one writing meta.json once its shards are on disk. Both say so in the documented
    words, and the older checkpoint is kept as it was."""
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, async_save=async_save))
    save(mgr, model, opt, 1)
    older = {f.name: f.read_bytes() for f in (tmp_path / "step_0000001").iterdir()}
    expected = ("saving checkpoint step_0000002 in .* failed: the directory is read-only or "
                "not writable.*older checkpoints there are kept")
    if async_save:
        mgr.save(2, {"model_optim": ModelOptimizer(model, opt), "train": Progress(2)},
                 {"step": 2})
        mgr.pending[0].result()  # the shards and their checksums are written
        refuse_writes(monkeypatch, tmp_path)
        with pytest.raises(CheckpointError, match=expected):
            mgr.wait()
    else:
        refuse_writes(monkeypatch, tmp_path)
        with pytest.raises(CheckpointError, match=expected):
            save(mgr, model, opt, 2)
    monkeypatch.undo()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1]
    assert older == {f.name: f.read_bytes() for f in (tmp_path / "step_0000001").iterdir()}
    mgr.close()


@pytest.mark.parametrize("damage", ["64 bytes flipped in place", "random bytes, same size"])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_corrupt_checkpoint_is_skipped_for_the_next_intact_one(tmp_path, caplog, compose,
                                                                 damage, async_save):
    """Every file's sha256 is written with the save (after an async save's writes, off the
    training thread) and checked before a resume: damage that keeps the file's size, which
    the size check cannot see, skips the checkpoint with a warning naming the file; an
    explicit resume_from it is refused."""
    import os

    from pretrain.checkpoint.folder import checkpoint_status
    from pretrain.checkpoint.resume import resume_path

    model, opt = trained_pair(0)
    run = tmp_path / "run"
    mgr = CheckpointManager(run / "checkpoints",
                            CheckpointConfig(enabled=True, async_save=async_save))
    save(mgr, model, opt, 1)
    save(mgr, model, opt, 2)
    mgr.close()
    newest = run / "checkpoints" / "step_0000002"
    meta = json.loads((newest / "meta.json").read_text())
    assert set(meta["sha256"]) == set(meta["files"]) and ".metadata" in meta["sha256"]
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    if damage.startswith("64"):
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    else:
        data = bytearray(os.urandom(len(data)))
    shard.write_bytes(bytes(data))
    assert checkpoint_status(newest) is None  # the sizes still match
    with caplog.at_level("WARNING"):
        assert resume_path(compose(["checkpoint.enabled=true"]), run) == \
            run / "checkpoints" / "step_0000001"
    assert f"{shard.name} do(es) not match the sha256" in caplog.text
    with pytest.raises(CheckpointError, match=f"step_0000002 is corrupt: {shard.name}"):
        resume_path(compose([f"checkpoint.resume_from={newest}"]), run)
