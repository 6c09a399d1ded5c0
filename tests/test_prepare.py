"""Data preparation as a job in stages: the same files whatever the number of workers or
tasks, resuming, refusing to merge half-done work, the bounded tokenizer sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA_NAME, REPO, TOKENIZER_VOCAB, make_data_config

from pretrain.data import encode as enc
from pretrain.data.prepare import (
    DataError,
    data_dir,
    encode,
    is_prepared,
    merge,
    plan,
    prepare,
    staging_dir,
)
from pretrain.data.sources import iter_documents, line_ranges, plan_pieces
from pretrain.data.split import ValidationRule
from pretrain.data.tokenizer import sample_documents

PIECE = 25_000  # the tiny corpus (10 files of ~11 KB) in 5 pieces of 2 files


def contents(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()}


def small_config(root: Path, **overrides):
    return make_data_config(root, piece_bytes=PIECE, **overrides)


@pytest.fixture(scope="module")
def one_worker(work_dir, tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("one")
    cwd = os.getcwd()
    os.chdir(work_dir)
    try:
        return contents(prepare(small_config(root), workers=1))
    finally:
        os.chdir(cwd)


def test_pieces_are_groups_of_files(in_work_dir):
    pieces = plan_pieces(small_config("unused"))
    assert [len(p["files"]) for p in pieces] == [2] * 5
    assert all(p["kind"] == "texts" and p["bytes"] <= PIECE for p in pieces)


@pytest.mark.parametrize("workers", [2, 3])
def test_same_files_whatever_the_workers(workers, one_worker, tmp_path, in_work_dir):
    out = prepare(small_config(tmp_path), workers=workers)
    assert contents(out) == one_worker
    index = json.loads(contents(out)["index.json"])
    assert index["pieces"] == 5 and index["dtype"] == "uint16"
    assert [s["file"] for s in index["splits"]["train"]["shards"]] == \
        [f"train_{i:03d}.bin" for i in range(5)]
    assert not [p for p in tmp_path.iterdir() if p.name != DATA_NAME]  # no staging left


def test_stages_task_by_task_same_files_and_merge_names_missing(one_worker, tmp_path,
                                                                in_work_dir):
    cfg = small_config(tmp_path)
    staging = plan(cfg)
    assert staging == staging_dir(cfg) and (staging / "plan.json").exists()
    encode(cfg, 2, 3)  # pieces 2
    encode(cfg, 0, 3)  # pieces 0, 3
    with pytest.raises(DataError) as e:
        merge(cfg)
    msg = str(e.value)
    assert "2 of 5 pieces" in msg and "1, 4" in msg and "--stage encode --task K --of N" in msg
    assert not data_dir(cfg).exists() and not is_prepared(cfg)
    encode(cfg, 1, 3)  # pieces 1, 4
    out = merge(cfg)
    assert contents(out) == one_worker and is_prepared(cfg)
    # Every stage is now a no-op.
    assert plan(cfg) is None and encode(cfg, 0, 3) is None and merge(cfg) == out


def test_resume_skips_done_pieces(one_worker, tmp_path, in_work_dir, monkeypatch):
    cfg = small_config(tmp_path)
    real, calls = enc.encode_piece, []

    def fail_on_piece_3(staging, plan, i, tok, progress):
        calls.append(i)
        if i == 3:
            raise RuntimeError("node lost")
        return real(staging, plan, i, tok, progress)

    monkeypatch.setattr(enc, "encode_piece", fail_on_piece_3)
    with pytest.raises(RuntimeError, match="node lost"):
        prepare(cfg, workers=1)
    assert not data_dir(cfg).exists()
    staging = staging_dir(cfg)
    done = sorted(p.name for p in (staging / "done").iterdir())
    assert done == ["00000.json", "00001.json", "00002.json"]
    calls.clear()
    monkeypatch.setattr(enc, "encode_piece", lambda *a: calls.append(a[2]) or real(*a))
    out = prepare(cfg, workers=1)
    assert calls == [3, 4]
    assert contents(out) == one_worker


def test_finished_dir_with_another_fingerprint_is_never_overwritten(tmp_path, in_work_dir):
    out = prepare(small_config(tmp_path), workers=1)
    before = contents(out)
    other = small_config(tmp_path, seed=99)
    for stage in (lambda: plan(other), lambda: encode(other, 0, 1), lambda: merge(other),
                  lambda: prepare(other)):
        with pytest.raises(DataError, match="not overwritten"):
            stage()
    assert contents(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name != DATA_NAME]


def test_tokenizer_trained_on_the_sample_only(tmp_path, monkeypatch):
    """A JSONL corpus in 4 pieces of 6 documents of ~730 characters, a sample cap of 1000:
    the sample is the first document of pieces 0 and 2 (spread, not the start), and a word
    found only in piece 3 never becomes a token."""
    monkeypatch.chdir(tmp_path)
    words = ["alpha", "betas", "gamma", "delta"]
    lines = []
    for piece in range(4):
        for d in range(6):  # documents of equal length, so the pieces hold 6 each
            other = "zyzzy" if piece == 3 else words[(piece + d + 1) % 4]
            body = " ".join([words[(piece + d) % 4], other] * 60)
            lines.append(json.dumps({"text": f"doc {piece}.{d}: {body}", "meta": {"n": d}}))
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    cfg = make_data_config(tmp_path / "data", source="json", data_files=["c.jsonl"],
                           piece_bytes=6 * (len(lines[0]) + 1), tokenizer_sample_bytes=1000,
                           validation_fraction=0.0, tokenizer_vocab_size=400)
    pieces = plan_pieces(cfg)
    assert len(pieces) == 4
    texts, _ = sample_documents(cfg, pieces)
    assert [t.split(":")[0] for t in texts] == ["doc 0.0", "doc 2.0"]
    out = prepare(cfg)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert not [t for t in vocab if "zyzz" in t]
    assert any("alpha" in t for t in vocab)
    index = json.loads((out / "index.json").read_text())
    assert index["splits"]["train"]["documents"] == 24


def test_json_lines_byte_ranges_read_every_record_once(tmp_path):
    rng = np.random.default_rng(0)
    records = [{"text": "x" * int(n), "id": i} for i, n in enumerate(rng.integers(0, 300, 500))]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ranges = line_ranges(str(path), 1000)
    assert ranges[0]["start"] == 0 and ranges[-1]["end"] == path.stat().st_size
    assert all(a["end"] == b["start"] for a, b in zip(ranges, ranges[1:], strict=False))
    data = path.read_bytes()
    assert all(data[r["end"] - 1: r["end"]] == b"\n" for r in ranges)
    cfg = make_data_config(tmp_path, source="json")
    docs = [d for r in ranges for d in iter_documents(r, cfg)]
    assert docs == [r["text"] for r in records]


def test_parquet_row_groups_are_pieces(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    texts = [f"document number {i} " * 20 for i in range(60)]
    pq.write_table(pa.table({"text": texts, "n": list(range(60))}), "c.parquet",
                   row_group_size=20)
    cfg = make_data_config(tmp_path / "data", source="parquet", data_files=["c.parquet"],
                           piece_bytes=1, validation_fraction=0.0)
    pieces = plan_pieces(cfg)
    assert [p["row_groups"] for p in pieces] == [[0], [1], [2]]
    out = prepare(cfg, workers=1)
    index = json.loads((out / "index.json").read_text())
    assert index["splits"]["train"]["documents"] == 60 and index["pieces"] == 3


def test_validation_rule_is_evenly_spaced_and_never_empty():
    rule = ValidationRule(0.1, seed=1, piece=0)
    picks = [rule.next() for _ in range(100)]
    assert picks[0] and sum(picks) == 10
    gaps = np.diff(np.flatnonzero(picks))
    assert set(gaps) == {10}
    for piece in range(1, 20):
        rule = ValidationRule(0.01, seed=1, piece=piece)
        assert sum(rule.next() for _ in range(1000)) == 10
    assert not any(ValidationRule(0.0, 1, 0).next() for _ in range(10))


def test_cli_stages_exit_codes_and_slurm_array_env(tmp_path, work_dir, monkeypatch):
    """The stage CLI as the Slurm chain calls it: merge before every piece is encoded is exit
    code 2 naming the pieces; the array task comes from SLURM_ARRAY_TASK_ID/MIN/COUNT."""
    from helpers import CORPUS_FILES

    monkeypatch.chdir(work_dir)
    cfg = small_config(tmp_path)
    args = [sys.executable, str(REPO / "tools" / "prepare_data.py"), "data=local-text",
            f"data.name={DATA_NAME}", f"data.data_files=[{','.join(CORPUS_FILES)}]",
            f"data.tokenizer_vocab_size={TOKENIZER_VOCAB}", "data.validation_fraction=0.1",
            f"data.piece_bytes={PIECE}", f"data.root={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO / "src")

    def run(*extra, **more_env):
        return subprocess.run([*args, *extra], capture_output=True, text=True,
                              env={**env, **more_env}, timeout=120)

    plan(cfg)  # the CLI's config is this one: same fingerprint, same staging dir
    p = run("--stage", "merge")
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "0-4" in p.stderr
    # Array ids 1..2 (--array=1-2): the second task is task 1 of 2, pieces 1 and 3.
    p = run("--stage", "encode", SLURM_ARRAY_TASK_ID="2", SLURM_ARRAY_TASK_MIN="1",
            SLURM_ARRAY_TASK_COUNT="2")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["encoded"] == 2
    assert sorted(f.name for f in (staging_dir(cfg) / "done").iterdir()) == \
        ["00001.json", "00003.json"]
    encode(cfg, 0, 2)
    p = run("--stage", "merge")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["tokens"]["validation"] > 0
    assert is_prepared(cfg)


def test_named_tokenizer_encodes_like_the_trained_one(one_worker, tmp_path, in_work_dir):
    """data.tokenizer=<a Hugging Face tokenizer> (here a local directory: no hub) goes through
    transformers and gives the very tokens of the same tokenizer trained as bpe."""
    from transformers import PreTrainedTokenizerFast

    trained = tmp_path / "trained.json"
    trained.write_bytes(one_worker["tokenizer.json"])
    PreTrainedTokenizerFast(tokenizer_file=str(trained), eos_token="<|endoftext|>") \
        .save_pretrained(tmp_path / "named")
    out = prepare(small_config(tmp_path / "data", tokenizer=str(tmp_path / "named")))
    bins = {k: v for k, v in contents(out).items() if k.endswith(".bin")}
    assert bins == {k: v for k, v in one_worker.items() if k.endswith(".bin")}
    index = json.loads(contents(out)["index.json"])
    assert index["vocab_size"] == TOKENIZER_VOCAB and index["dtype"] == "uint16"


def test_two_processes_preparing_the_same_data_at_once_give_one_copy(one_worker, tmp_path,
                                                                     in_work_dir):
    """Two processes asked for the same fresh data dir at once (torchft's replica groups
    starting together): the second waits for the first's preparation and finds it done, the
    files those of one worker, nothing left beside the dir. They used to encode the same
    pieces into one staging dir and race on its temporary files."""
    import multiprocessing

    from pretrain.data import prepare as prep

    cfg = small_config(tmp_path)
    ctx = multiprocessing.get_context("fork")
    entered, release = ctx.Event(), ctx.Event()
    real_plan = prep.plan

    def slow_plan(c):  # the first process, inside its preparation, waits for the second
        entered.set()
        release.wait(60)
        return real_plan(c)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prep, "plan", slow_plan)
        first = ctx.Process(target=prepare, args=(cfg, 1))
        first.start()
    assert entered.wait(60)
    second = ctx.Process(target=prepare, args=(cfg, 1))
    second.start()
    lock = staging_dir(cfg) / prep.LOCK
    for _ in range(600):  # until the second waits on the lock the first holds
        if second.exitcode is not None or _flocks_on(lock) >= 2:
            break
        second.join(0.05)
    assert second.exitcode is None and _flocks_on(lock) == 2  # one held, one waiting
    release.set()
    first.join(60)
    second.join(60)
    assert first.exitcode == 0 and second.exitcode == 0
    assert contents(data_dir(cfg)) == one_worker
    assert [p.name for p in tmp_path.iterdir()] == [data_dir(cfg).name]


def _flocks_on(path: Path) -> int:
    """flock()s held or waited for on ``path`` (/proc/locks)."""
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return 0
    return sum(f":{inode} " in ln for ln in Path("/proc/locks").read_text().splitlines())


def test_a_preparation_that_fails_before_planning_leaves_nothing(tmp_path, in_work_dir):
    """A missing data file fails the plan: no staging dir (nor its lock) is left in the root,
    so the next run starts as the first did."""
    cfg = small_config(tmp_path, data_files=[*small_config(tmp_path).data_files, "missing.txt"])
    with pytest.raises((DataError, FileNotFoundError)):
        prepare(cfg, workers=1)
    assert list(tmp_path.iterdir()) == []


def test_a_file_system_without_locks_still_prepares(one_worker, tmp_path, in_work_dir,
                                                    monkeypatch, caplog):
    """Where flock is not supported (Lustre mounted without ``-o flock``: ENOSYS) the
    preparation goes on without the lock, saying so."""
    import errno
    import fcntl
    import logging

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with caplog.at_level(logging.WARNING):
        out = prepare(small_config(tmp_path), workers=1)
    assert contents(out) == one_worker and "no file lock" in caplog.text
