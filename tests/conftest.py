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
# A pytest-xdist worker (README's ``-n auto``: one a core) runs with one OpenMP thread, and so
# does every process it starts: two workers each running a team of 2 threads on 2 cores
# spin-wait for each other (a 7-second train.py run took 28 s beside another worker).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from helpers import (  # noqa: E402
    CORPUS_FILES,
    DATA_NAME,
    compose_config,
    make_data_config,
    one_thread,
    write_corpus,
    write_markov_data,
)

from pretrain.config.naming import register_resolvers  # noqa: E402
from pretrain.config.schema import Config  # noqa: E402
from pretrain.config.structured import register_configs  # noqa: E402
from pretrain.hardware.device import inductor_cache_per_isa  # noqa: E402

register_configs()
register_resolvers()
# Under the AVX2 imitation (``ATEN_CPU_CAPABILITY=avx2``) inductor's cache is kept apart from
# the machine's own: the tests that compile, and the runs they start, inherit the folder.
inductor_cache_per_isa()


@pytest.fixture(scope="session", autouse=True)
def cpu_peaks(tmp_path_factory) -> None:
    """The CPU's fp32 and bf16 matmul peaks at one thread (a run's MFU denominator),
    measured once per pytest run (tests/built_once.py) and handed to every run of the
    session, in this process and in those it starts (pretrain.train.metrics.CPU_PEAKS_ENV):
    each process that trained (a train.py, a rank 0, a pytest worker) measured them
    itself, about 2 s of CPU each (issue 69).
    tests/test_any_machine.py checks the measurement; a run with another dtype or thread
    count measures its own."""
    import json

    from built_once import built_once

    from pretrain.train.metrics import CPU_PEAKS_ENV

    if CPU_PEAKS_ENV not in os.environ:
        os.environ[CPU_PEAKS_ENV] = json.dumps(built_once(tmp_path_factory, "cpu-peaks",
                                                          lambda _: measure_cpu_peaks()))


@pytest.fixture(scope="session", autouse=True)
def shared_fits(tmp_path_factory) -> None:
    """Each scaling-law fit computed by one worker of the pytest run and read by the others
    (tests/fit_cache.py): the fit modules refit the same published ladders."""
    from fit_cache import share_fits

    share_fits(tmp_path_factory)


def measure_cpu_peaks() -> dict[str, float]:
    import torch

    from pretrain.hardware.device import measure_matmul_flops
    from pretrain.train.metrics import peak_key

    cpu = torch.device("cpu")
    with one_thread():
        return {peak_key(dtype, 1): measure_matmul_flops(dtype, cpu)
                for dtype in (torch.float32, torch.bfloat16)}


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
    """Whole modules in the order ``module_rank`` gives them; the gpu tier (tests marked
    ``gpu``: ``pytest -m gpu`` on a GPU box) is skipped, saying why, where torch sees no
    CUDA device."""
    import torch

    rank = {}
    for item in items:
        rank[item.module] = min(rank.get(item.module, 2), module_rank(item))
    items.sort(key=lambda item: rank[item.module])  # stable: each module's own order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: the gpu tier runs with pytest -m gpu "
                                   "on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, the project, the test modules) stays for the whole
    session: frozen out of the garbage collector's sight, as train.py does, so that the full
    collections between and inside ~1,400 tests do not walk it again each time."""
    import gc

    gc.freeze()


def module_rank(item) -> int:
    """0 for the modules of Slurm jobs, 1 for the other slow ones (multi-process runs), 2 for
    the rest: under ``-n auto`` the longest first (worksteal hands out the collection in
    contiguous halves, then idle workers take the tail), and the Slurm tests, which mostly
    wait for clusters and jobs, beside the other worker's training rather than alone at the
    end (issue 69: the multi-node module was the last 7 minutes of a 39-minute run, one
    worker idle). A module stays whole: its module fixtures are built once."""
    if item.get_closest_marker("slurm") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


# README's test command runs the suite in parallel (``-n auto``, pytest-xdist). Almost every
# test holds one core (one intra-op thread, as torchrun gives each rank), so on the 2-core CI
# machine one process left a core idle: 28 min serial, 16-20 with two workers.
MAX_WORKERS = 8  # a multi-rank test starts up to 8 processes of its own; each worker ~1 GB


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the GPU box may not have xdist
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at most MAX_WORKERS; none for the gpu tier
    (``-m gpu``: its tests share the one GPU and some time it) or when
    PYTEST_XDIST_AUTO_NUM_WORKERS says otherwise."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    mark = config.option.markexpr or ""
    if "gpu" in mark and "not gpu" not in mark:
        return 0
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config) -> None:
    """Under ``-n``, ``--dist worksteal`` unless ``--dist`` says otherwise: an idle worker takes
    tests queued for a busy one, so one long multi-rank test does not leave a core idle at the
    end. (Whole files to a worker, ``--dist loadfile``, builds each module fixture once, but
    its scheduler stops the whole run with an INTERNALERROR when a worker dies, pytest-xdist
    3.8.0: a test that aborts the process must be a failure of that test, not of the run.)"""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "worksteal"


def pytest_terminal_summary(terminalreporter) -> None:
    """Name what the tests marked ``slurm`` did, so a CI log shows the Slurm tests passed
    rather than skipped (quiet output shows only dots)."""
    seen: dict[str, str] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if "slurm" in getattr(rep, "keywords", {}) and rep.nodeid not in seen:
                seen[rep.nodeid] = outcome
    if seen:
        tally = ", ".join(f"{sum(v == o for v in seen.values())} {o}"
                          for o in ("passed", "failed", "skipped", "error")
                          if o in seen.values())
        terminalreporter.write_line(f"Slurm tests: {tally}")
        for nodeid, outcome in sorted(seen.items()):
            terminalreporter.write_line(f"  {outcome} {nodeid}")
