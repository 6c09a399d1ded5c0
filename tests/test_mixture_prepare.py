"""A mixture prepared as one job (src/pretrain/data/mixture_prepare.py, docs/mixtures.md):
every source that says how it is built is prepared with one tokenizer, a second call is a
no-op, a prepared source is never rewritten; and the local-corpus builders
(data/local_corpora.py) find their files under data.roots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TOKENIZER_VOCAB, compose_config, make_data_config

from pretrain.config.schema import ConfigError, DataConfig, MixtureSource
from pretrain.data.errors import DataError
from pretrain.data.local_corpora import find_files
from pretrain.data.mixture_prepare import needs_mixture_preparation, prepare_mixture
from pretrain.data.prepare import prepare
from pretrain.decision.checks import check
from pretrain.tools import prepare_data

WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import", "the", "docs"]


def write_texts(d: Path, suffixes: tuple[str, ...], n: int = 6) -> list[Path]:
    files = []
    for i in range(n):
        f = d / f"pkg{i % 2}" / f"f{i}{suffixes[i % len(suffixes)]}"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("\n".join(" ".join(WORDS[(i + j + k) % len(WORDS)] for k in range(8))
                               for j in range(60)) + "\n")
        files.append(f)
    return files


@pytest.fixture()
def trees(tmp_path) -> Path:
    """code/ (.py, plus what the builders skip), docs/ (.md .rst .txt), notes/ (.txt)."""
    write_texts(tmp_path / "code", (".py",))
    for skipped in ("__pycache__/x.py", "pkg-1.0.dist-info/y.py", "pkg0/data.json"):
        (tmp_path / "code" / skipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "code" / skipped).write_text("skipped = True\n")
    write_texts(tmp_path / "docs", (".md", ".rst", ".txt"))
    write_texts(tmp_path / "notes", (".txt",))
    return tmp_path


def mixture(trees: Path, **data) -> DataConfig:
    sources = [
        MixtureSource(name="code", weight=0.5, source="site-packages",
                      roots=[str(trees / "code")]),
        MixtureSource(name="docs", weight=0.3, source="local-docs",
                      roots=[str(trees / "docs")], validation_fraction=0.0),
        MixtureSource(name="notes", weight=0.2, source="text",
                      data_files=[str(trees / "notes" / "**" / "*.txt")]),
    ]
    return DataConfig(**{**dict(name="mixture", source="mixture", root=str(trees / "data"),
                                tokenizer_vocab_size=TOKENIZER_VOCAB, num_proc=1,
                                validation_fraction=0.1, mixture=sources), **data})


def test_the_builders_find_their_files_under_data_roots(trees):
    code = find_files(DataConfig(source="site-packages", roots=[str(trees / "code")]))
    assert [Path(f).name for f in code] == [f"f{i}.py" for i in (0, 2, 4, 1, 3, 5)]
    docs = find_files(DataConfig(source="local-docs", roots=[str(trees / "docs")]))
    assert sorted(Path(f).suffix for f in docs) == [".md", ".md", ".rst", ".rst", ".txt", ".txt"]
    with pytest.raises(DataError, match="data.source=local-docs found no"):
        find_files(DataConfig(source="local-docs", roots=[str(trees / "code")]))
    with pytest.raises(DataError, match="are not directories"):
        find_files(DataConfig(source="site-packages", roots=[str(trees / "nowhere")]))


def test_one_job_prepares_every_source_with_one_tokenizer(trees):
    cfg = mixture(trees)
    assert needs_mixture_preparation(cfg)
    summary = prepare_mixture(cfg)
    root = trees / "data"
    assert [s["name"] for s in summary] == ["code", "docs", "notes"]
    indexes = {n: json.loads((root / n / "index.json").read_text()) for n in ("code", "docs",
                                                                            "notes")}
    assert {n: ix["source"] for n, ix in indexes.items()} == {
        "code": "site-packages", "docs": "local-docs", "notes": "text"}
    docs = {n: sum(s["documents"] for s in ix["splits"].values()) for n, ix in indexes.items()}
    assert docs == {"code": 6, "docs": 6, "notes": 6}  # the skipped files are not read
    assert list(indexes["docs"]["splits"]) == ["train"]  # the entry's validation_fraction=0
    assert "validation" in indexes["code"]["splits"]  # data's 0.1
    toks = {(root / n / "tokenizer.json").read_bytes() for n in indexes}
    assert len(toks) == 1  # one tokenizer: code trained it, docs and notes reused it
    assert indexes["code"]["tokenizer"] == "bpe"
    assert indexes["notes"]["tokenizer"] == str(root / "code" / "tokenizer.json")
    assert not needs_mixture_preparation(cfg)

    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    assert [s["prepared_now"] for s in summary] == [True, True, True]
    assert [s["prepared_now"] for s in prepare_mixture(cfg)] == [False, False, False]
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == stamps


def test_the_cli_prepares_the_mixture_as_one_job(trees, capsys, monkeypatch):
    monkeypatch.chdir(trees)
    entries = (f"[{{name: code, weight: 0.7, source: site-packages, roots: ['{trees}/code']}},"
               f" {{name: notes, weight: 0.3, source: text, "
               f"data_files: ['{trees}/notes/**/*.txt']}}]")
    args = ["data=mixture", f"data.mixture={entries}", f"data.root={trees / 'data'}",
            f"data.tokenizer_vocab_size={TOKENIZER_VOCAB}", "data.num_proc=1"]
    assert prepare_data.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(s["name"], s["prepared_now"]) for s in out["mixture"]] == [("code", True),
                                                                         ("notes", True)]
    assert prepare_data.main([*args, "--stage", "plan"]) == 2
    assert "prepared as one job" in capsys.readouterr().err


def test_a_prepared_source_is_used_as_it_is_and_its_tokenizer_shared(trees):
    root = trees / "data"
    first = prepare(make_data_config(root, name="notes", data_files=[
        str(trees / "notes" / "**" / "*.txt")], validation_fraction=0.1))
    stamp = (first / "index.json").stat().st_mtime_ns
    prepare_mixture(mixture(trees))
    assert (first / "index.json").stat().st_mtime_ns == stamp
    tok = (first / "tokenizer.json").read_bytes()  # code and docs took notes' tokenizer
    assert all((root / n / "tokenizer.json").read_bytes() == tok for n in ("code", "docs"))


def test_a_prepared_source_with_another_tokenizer_stops_the_job_before_any_work(trees):
    root = trees / "data"
    code = prepare(make_data_config(root, name="code", data_files=[
        str(trees / "code" / "pkg0" / "*.py")], tokenizer_vocab_size=TOKENIZER_VOCAB))
    notes = prepare(make_data_config(root, name="notes", data_files=[
        str(trees / "notes" / "**" / "*.txt")], tokenizer_vocab_size=TOKENIZER_VOCAB + 20))
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    with pytest.raises(DataError, match=rf"sources \['notes'\] have another tokenizer.*"
                                        rf"data.tokenizer={code}/tokenizer.json"):
        prepare_mixture(mixture(trees))
    assert not (root / "docs").exists()  # nothing prepared, nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == before
    assert notes.exists()


def test_a_source_neither_prepared_nor_buildable_is_named(trees):
    cfg = mixture(trees)
    cfg.mixture[1] = MixtureSource(name="docs", weight=0.3)
    with pytest.raises(DataError, match=r"data.mixture\[1\].name=docs: no prepared data .* "
                                        "no source to prepare it from"):
        prepare_mixture(cfg)
    assert not (trees / "data" / "code").exists()


def test_preparation_keys_without_a_source_are_a_config_error():
    cfg = compose_config(["data=mixture", "data.mixture=[{name: a, weight: 1, "
                                          "data_files: [x.txt]}, {name: b, weight: 1}]"])
    with pytest.raises(ConfigError, match=r"data.mixture\[0\] \(a\) sets \['data_files'\] "
                                          "but no source"):
        check(cfg)


def test_a_one_process_run_prepares_its_mixture_first(trees):
    """The trainer's path: mixture_training_data prepares the missing sources of a
    one-process run and restates the plan's per-source sizes; with auto_prepare=false it
    does not."""
    from pretrain.data.run_data import mixture_training_data
    from pretrain.decision.resolve import resolve_plan

    entries = (f"[{{name: code, weight: 0.5, source: site-packages, roots: ['{trees}/code']}},"
               f" {{name: docs, weight: 0.5, source: local-docs, roots: ['{trees}/docs']}}]")
    args = ["model=nano", f"model.vocab_size={TOKENIZER_VOCAB}", "data=mixture",
            f"data.mixture={entries}", f"data.root={trees / 'data'}", "data.num_proc=1",
            f"data.tokenizer_vocab_size={TOKENIZER_VOCAB}", "budget=steps", "budget.steps=3",
            "model.seq_len=16", "train.global_batch_size=4", "parallel.micro_batch_size=4"]
    off = compose_config([*args, "data.auto_prepare=false"])
    with pytest.raises(DataError, match="no prepared data"):
        mixture_training_data(off, resolve_plan(off).decision, 1, 3)
    cfg = compose_config(args)
    run = resolve_plan(cfg)
    assert [s["data_tokens"] for s in run.plan["data_sources"]] == [None, None]
    assert [s.data_tokens for s in run.decision.sources] == [None, None]
    train, entries = mixture_training_data(cfg, run.decision, 1, 3)
    sizes = [json.loads((trees / "data" / n / "index.json").read_text())["splits"]["train"]
             ["tokens"] for n in ("code", "docs")]
    assert [s["data_tokens"] for s in entries["data_sources"]] == sizes
    assert train.batch(0, 4)[0].shape == (4, 16)
