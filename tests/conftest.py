"""Shared fixtures: in-process Hydra composition, a tiny local text corpus and its shards.

Nothing here downloads: the hub is switched off for the whole session, the corpus is a few
generated .txt files, and the tokenizer is a 300-token byte-level BPE trained on them.
"""

from __future__ import annotations

import os
import random
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
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from pretrain.config import Config, DataConfig, register_configs  # noqa: E402
from pretrain.naming import register_resolvers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
# The recipes sized for a CPU; every other recipe is meant for GPUs (a new recipe counts as
# one until it is listed here).
CPU_RECIPES = {"tiny", "tiny-zero3", "llama-tiny", "nano-3d", "nano-zbv", "ladder-tiny",
               "isoflop-tiny", "gpt2-124m-cpu", "hparam-tiny"}
GPU_RECIPES = sorted(set(RECIPES) - CPU_RECIPES)

# The tiny corpus: 10 documents (one per file) of short, very regular sentences, so a nano
# model learns something in a few dozen steps. Paths are relative to the work directory.
N_DOCS = 10
CORPUS_FILES = [f"corpus/doc{i:02d}.txt" for i in range(N_DOCS)]
TOKENIZER_VOCAB = 300
DATA_NAME = "tinytext"

register_configs()
register_resolvers()


def write_corpus(root: Path) -> list[str]:
    """Write CORPUS_FILES under ``root`` (deterministic content); return their texts."""
    rng = random.Random(0)
    subjects = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a child"]
    verbs = ["sees", "likes", "finds", "wants", "holds", "draws"]
    objects = ["a red ball", "the big tree", "some water", "a small house", "the green hat",
               "an apple"]
    texts = []
    (root / "corpus").mkdir(parents=True, exist_ok=True)
    for name in CORPUS_FILES:
        lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
                 for _ in range(400)]
        text = "\n".join(lines) + "\n"
        (root / name).write_text(text)
        texts.append(text)
    return texts


def make_data_config(root: Path | str, **overrides) -> DataConfig:
    """The DataConfig of the tiny corpus (relative data_files: run from the work dir)."""
    kwargs = dict(
        name=DATA_NAME, source="text", data_files=list(CORPUS_FILES), tokenizer="bpe",
        tokenizer_vocab_size=TOKENIZER_VOCAB, validation_fraction=0.1, num_proc=1,
        root=str(root),
    )
    kwargs.update(overrides)
    return DataConfig(**kwargs)


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Compose conf/config.yaml + overrides exactly as the tools do (pretrain.cli, the same
    path train.py's config takes), then unset HydraConfig so tests stay independent."""
    from pretrain.cli import compose_config as compose_like_the_tools

    try:
        return compose_like_the_tools(list(overrides), CONF_DIR)
    finally:
        HydraConfig.instance().cfg = None


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
