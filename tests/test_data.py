"""Data preparation (shards, index, tokenizer, reuse, refusal to overwrite) and the loader."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import CORPUS_FILES, DATA_NAME, N_DOCS, TOKENIZER_VOCAB, make_data_config

from pretrain.data.loader import TokenWindows
from pretrain.data.prepare import DataError, fingerprint, prepare


def snapshot(path: Path) -> dict[str, tuple[int, str]]:
    """mtime (ns) and content hash of every file in ``path``."""
    return {f.name: (f.stat().st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest())
            for f in sorted(path.iterdir())}


def read_split(path: Path, index: dict, split: str) -> np.ndarray:
    dtype = np.dtype(index["dtype"])
    return np.concatenate([np.fromfile(path / s["file"], dtype=dtype)
                           for s in index["splits"][split]["shards"]])


def test_prepare_writes_index_tokenizer_and_shards(prepared):
    files = {f.name for f in prepared.iterdir()}
    assert {"index.json", "tokenizer.json", "train_000.bin", "validation_000.bin"} <= files
    index = json.loads((prepared / "index.json").read_text())
    assert index["vocab_size"] == TOKENIZER_VOCAB
    assert index["dtype"] == "uint16"
    assert index["splits"]["validation"]["documents"] == 1  # 10% of 10 documents
    assert index["splits"]["train"]["documents"] == N_DOCS - 1
    for split in ("train", "validation"):
        shards = index["splits"][split]["shards"]
        on_disk = sum((prepared / s["file"]).stat().st_size // 2 for s in shards)
        assert on_disk == sum(s["tokens"] for s in shards) == index["splits"][split]["tokens"]
        assert index["splits"][split]["tokens"] > 1000
    tokens = np.concatenate([read_split(prepared, index, s) for s in ("train", "validation")])
    assert int(tokens.max()) == index["max_token_id"] < TOKENIZER_VOCAB


def test_shards_decode_back_to_the_documents(prepared, corpus_texts):
    """Every document appears exactly once, in one split, ended by EOS, losslessly."""
    from tokenizers import Tokenizer

    index = json.loads((prepared / "index.json").read_text())
    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    assert tok.get_vocab_size() == TOKENIZER_VOCAB
    assert tok.token_to_id("<|endoftext|>") == index["eos_id"]
    decoded = []
    for split in ("train", "validation"):
        ids = read_split(prepared, index, split)
        assert ids[-1] == index["eos_id"]
        docs = np.split(ids, np.flatnonzero(ids == index["eos_id"]) + 1)[:-1]
        assert len(docs) == index["splits"][split]["documents"]
        decoded += [tok.decode(d[:-1].tolist()) for d in docs]
    assert sorted(decoded) == sorted(corpus_texts)


def test_prepare_twice_reuses_without_rewriting(prepared_copy, in_work_dir):
    before = snapshot(prepared_copy)
    out = prepare(make_data_config(prepared_copy.parent))
    assert out == prepared_copy
    assert snapshot(prepared_copy) == before
    assert not [p for p in prepared_copy.parent.iterdir() if p.name != DATA_NAME]


def test_different_settings_same_name_refused_and_untouched(prepared_copy, in_work_dir):
    before = snapshot(prepared_copy)
    with pytest.raises(DataError) as e:
        prepare(make_data_config(prepared_copy.parent, tokenizer_vocab_size=280))
    msg = str(e.value)
    assert str(prepared_copy) in msg and "data.name" in msg and "not overwritten" in msg
    assert snapshot(prepared_copy) == before
    assert not [p for p in prepared_copy.parent.iterdir() if p.name != DATA_NAME]


def test_edited_data_file_is_a_different_preparation(prepared_copy, in_work_dir):
    before = snapshot(prepared_copy)
    doc = in_work_dir / "corpus" / "extra.txt"
    doc.write_text("one more document.\n")
    files = [*CORPUS_FILES, "corpus/extra.txt"]
    try:
        with pytest.raises(DataError, match="different settings"):
            prepare(make_data_config(prepared_copy.parent, data_files=files))
    finally:
        doc.unlink()
    assert snapshot(prepared_copy) == before


def test_missing_data_file(tmp_path, in_work_dir):
    with pytest.raises(DataError) as e:
        prepare(make_data_config(tmp_path, data_files=["corpus/doc00.txt", "corpus/nope.txt"]))
    assert "data.data_files" in str(e.value) and "corpus/nope.txt" in str(e.value)
    assert not (tmp_path / DATA_NAME).exists()
    assert not list(tmp_path.iterdir())  # no temporary directory left behind


def test_no_data_files(tmp_path, in_work_dir):
    with pytest.raises(DataError, match=r"data\.data_files is empty"):
        prepare(make_data_config(tmp_path, data_files=[]))
    assert not list(tmp_path.iterdir())


def test_empty_data_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text("")
    with pytest.raises(DataError, match=r"data\.data_files"):
        prepare(make_data_config(tmp_path / "data", data_files=["a.txt", "b.txt", "c.txt"],
                                 validation_fraction=0.0))
    assert not (tmp_path / "data" / DATA_NAME).exists()


def test_absolute_data_file_paths(tmp_path, work_dir):
    files = [str(work_dir / f) for f in CORPUS_FILES[:3]]
    out = prepare(make_data_config(tmp_path, data_files=files, validation_fraction=0.0))
    assert json.loads((out / "index.json").read_text())["splits"]["train"]["documents"] == 3


# -- loader ---------------------------------------------------------------------------------


def test_windows_targets_are_inputs_shifted(prepared):
    index = json.loads((prepared / "index.json").read_text())
    tokens = read_split(prepared, index, "train").astype(np.int64)
    data = TokenWindows(prepared, "train", seq_len=32, shuffle=False)
    assert data.n_windows == (len(tokens) - 1) // 32
    x, y = data.batch(5, 3)
    assert x.shape == y.shape == (3, 32)
    assert str(x.dtype) == "torch.int64"
    for row in range(3):
        start = (5 + row) * 32
        np.testing.assert_array_equal(x[row].numpy(), tokens[start: start + 32])
        np.testing.assert_array_equal(y[row].numpy(), tokens[start + 1: start + 33])


def test_windows_same_seed_same_batches_other_seed_other_order(prepared):
    a = TokenWindows(prepared, "train", seq_len=32, seed=7)
    b = TokenWindows(prepared, "train", seq_len=32, seed=7)
    c = TokenWindows(prepared, "train", seq_len=32, seed=8)
    # Sample i is a pure function of (seed, i): read out of order, from a fresh loader.
    xa, ya = a.batch(100, 8)
    b.batch(3000, 4)
    xb, yb = b.batch(100, 8)
    assert (xa == xb).all() and (ya == yb).all()
    xc, _ = c.batch(100, 8)
    assert not (xa == xc).all()
    x0, _ = a.batch(0, 8)
    assert not (x0 == xa).all()


def test_windows_cover_each_epoch_exactly_once(prepared):
    data = TokenWindows(prepared, "train", seq_len=32, seed=3)
    plain = TokenWindows(prepared, "train", seq_len=32, shuffle=False)
    n = data.n_windows
    every = sorted(tuple(plain.window(i)) for i in range(n))
    epoch0 = [tuple(data.window(i)) for i in range(n)]
    epoch1 = [tuple(data.window(n + i)) for i in range(n)]
    assert sorted(epoch0) == every
    assert sorted(epoch1) == every
    assert epoch0 != epoch1  # each epoch has its own order
    assert epoch0 != [tuple(plain.window(i)) for i in range(n)]


def test_split_too_short_for_one_window(prepared):
    with pytest.raises(DataError, match=r"model\.seq_len"):
        TokenWindows(prepared, "validation", seq_len=100_000)


def test_missing_split_and_missing_index(prepared, tmp_path):
    with pytest.raises(DataError, match="no 'test' split"):
        TokenWindows(prepared, "test", seq_len=32)
    with pytest.raises(DataError, match="index.json missing"):
        TokenWindows(tmp_path, "train", seq_len=32)


def test_prepare_is_not_left_half_done(tmp_path, in_work_dir, monkeypatch):
    """A preparation that fails midway leaves no data dir that a later run would reuse
    (only its staging dir, which the next run resumes from)."""
    import pretrain.data.encode as enc

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(enc, "encode_piece", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare(make_data_config(tmp_path))
    assert not (tmp_path / DATA_NAME).exists()
    assert [p.name for p in tmp_path.iterdir()] == [f".{DATA_NAME}.staging-" + 
                                                     fingerprint(make_data_config(tmp_path))]


def test_invalid_utf8_is_replaced_and_counted_in_a_warning(tmp_path, caplog):
    from pretrain.data.sources import decode_utf8

    raw = "caf\u00e9 ok\n".encode() + b"\xff\xfe binary \xc3\n" + "\ufffd kept\n".encode()
    with caplog.at_level("WARNING", logger="pretrain"):
        text = decode_utf8(raw, "notes.txt")
    assert text == "caf\u00e9 ok\n\ufffd\ufffd binary \ufffd\n\ufffd kept\n"
    assert "notes.txt: 3 invalid UTF-8 sequence(s) replaced by U+FFFD" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pretrain"):
        assert decode_utf8("plain \ufffd\n".encode(), "ok.txt") == "plain \ufffd\n"
    assert caplog.text == ""
