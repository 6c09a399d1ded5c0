"""Shared fixtures: in-process Hydra composition, a tiny local text corpus and its shards.
The plain functions and constants behind them are in tests/helpers.py.

Nothing here downloads: the hub is switched off for the whole session, the corpus is a few
generated .txt files, and the tokenizer is a 300-token byte-level BPE trained on them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

# Before anything imports datasets/transformers/wandb: no network, no wandb files.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
from helpers import (  # noqa: E402
    CORPUS_FILES,
    DATA_NAME,
    compose_config,
    make_data_config,
    write_corpus,
    write_markov_data,
)

from pretrain.config.naming import register_resolvers  # noqa: E402
from pretrain.config.schema import Config, register_configs  # noqa: E402

register_configs()
register_resolvers()


@pytest.fixture
def compose() -> Callable[..., Config]:
    return compose_config


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory) -> Path:
    """A directory holding corpus/doc*.txt; data_files are relative to it."""
    root = tmp_path_factory.mktemp("work")
    write_corpus(root)
    return root


@pytest.fixture(scope="session")
def corpus_texts(work_dir) -> list[str]:
    return [(work_dir / f).read_text() for f in CORPUS_FILES]


@pytest.fixture(scope="session")
def prepared(work_dir) -> Path:
    """The tiny corpus prepared once for the session (read-only for tests: copy to modify)."""
    from pretrain.data.prepare import prepare

    cwd = os.getcwd()
    os.chdir(work_dir)
    try:
        return prepare(make_data_config(work_dir / "data"))
    finally:
        os.chdir(cwd)


@pytest.fixture
def in_work_dir(work_dir, monkeypatch) -> Iterator[Path]:
    monkeypatch.chdir(work_dir)
    yield work_dir


@pytest.fixture
def prepared_copy(prepared, tmp_path) -> Path:
    """A private copy (mtimes kept) of the prepared shards, under tmp_path/data."""
    dst = tmp_path / "data" / DATA_NAME
    shutil.copytree(prepared, dst)
    return dst


@pytest.fixture(scope="session")
def markov_root(tmp_path_factory) -> Path:
    """A data root holding the Markov-chain data as ``markov`` (overrides:
    helpers.MARKOV_DATA + ``data.root=<this>``); read-only for tests."""
    root = tmp_path_factory.mktemp("markov_data")
    write_markov_data(root / "markov")
    return root


def pytest_collection_modifyitems(config, items) -> None:
    """The gpu tier (tests marked ``gpu``: ``pytest -m gpu`` on a GPU box) is skipped,
    saying why, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: the gpu tier runs with pytest -m gpu "
                                   "on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
