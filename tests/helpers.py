"""Plain functions and constants the test files share (fixtures live in conftest.py).

One place for each: where the repository and its recipes are, the tiny text corpus and its
DataConfig, composing a config the way the tools do, the synthetic Markov-chain data the
training tests use, starting torchrun for a worker script, reading what a run wrote
(metrics.jsonl, result.json), and collecting validation problems.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hydra.core.hydra_config import HydraConfig

from pretrain.config.schema import Config, ConfigError, DataConfig
from pretrain.decision.checks import check
from pretrain.launch.lifeline import parent_of

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONF_DIR = REPO / "conf"
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
# The recipes sized for a CPU; every other recipe is meant for GPUs (a new recipe counts as
# one until it is listed here).
CPU_RECIPES = {"tiny", "tiny-zero3", "llama-tiny", "nano-3d", "nano-zbv", "ladder-tiny",
               "isoflop-tiny", "gpt2-124m-cpu", "hparam-tiny", "moe-tiny",
               "ladder-tiny-wsd", "ladder-tiny-cooldown", "transfer-tiny", "mixture-tiny",
               "mixture-local", "ladder-mix", "ladder-mix-cooldown", "ladder-mix-h1",
               "ladder-mix-h1-cooldown", "ladder-bytes", "ladder-bytes-cooldown",
               "ladder-pinned", "ladder-pinned-cooldown"}
GPU_RECIPES = sorted(set(RECIPES) - CPU_RECIPES)

# The tiny corpus: 10 documents (one per file) of short, very regular sentences, so a nano
# model learns something in a few dozen steps. Paths are relative to the work directory.
N_DOCS = 10
CORPUS_FILES = [f"corpus/doc{i:02d}.txt" for i in range(N_DOCS)]
TOKENIZER_VOCAB = 300
DATA_NAME = "tinytext"

# The Markov-chain data (write_markov_data): its vocabulary, and the overrides that read it.
VOCAB = 256
MARKOV_DATA = ["data.name=markov", "data.auto_prepare=false",
               f"data.tokenizer_vocab_size={VOCAB}"]


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


# Tests mean the CPU unless they say otherwise: on a machine with a GPU ``train.device=auto``
# would pick it (and bf16, NCCL, cuda:LOCAL_RANK for every rank). The gpu tier (pytest -m
# gpu) names ``train.device=cuda``.
CPU = "train.device=cpu"


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Compose conf/config.yaml + overrides exactly as the tools do (pretrain.config.compose, the
    same
    path train.py's config takes), then unset HydraConfig so tests stay independent. On the
    CPU (``CPU``) unless the overrides name ``train.device``."""
    from pretrain.config.compose import compose_config as compose_like_the_tools

    overrides = list(overrides)
    if not any(o.lstrip("+~").startswith("train.device=") for o in overrides):
        overrides.append(CPU)
    try:
        return compose_like_the_tools(overrides, CONF_DIR)
    finally:
        HydraConfig.instance().cfg = None


def compose_all(overrides: dict[str, list[str]]) -> dict[str, Config]:
    """``compose_config`` of each entry: once here, not once per rank and run in a worker
    (a composition costs about as much as training a nano model a few steps)."""
    return {name: compose_config(o) for name, o in overrides.items()}


def write_spec(path: Path, **spec: Any) -> Path:
    """A worker's instructions (composed configs included), pickled; read_spec reads them."""
    path.write_bytes(pickle.dumps(spec))
    return path


def read_spec(path: Path | str) -> dict[str, Any]:
    return pickle.loads(Path(path).read_bytes())


def problems(cfg: Config, world_size: int | None = None) -> list[str]:
    """Every problem validation reports for ``cfg`` (it must report at least one)."""
    with pytest.raises(ConfigError) as e:
        check(cfg, world_size)
    return e.value.problems


def write_markov_data(path: Path, seed: int = 0) -> None:
    """A prepared-data directory (index.json + uint16 shards, as data/prepare.py writes)
    holding a random sparse Markov chain: structure a model learns, made in milliseconds."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, VOCAB, size=(VOCAB, 4))
    splits = {}
    for split, n in (("train", 60_000), ("validation", 6_000)):
        tokens = np.empty(n, dtype=np.uint16)
        tokens[0] = 1
        picks = rng.integers(0, 4, size=n)
        for i in range(1, n):
            tokens[i] = successors[tokens[i - 1], picks[i]]
        tokens.tofile(path / f"{split}_000.bin")
        splits[split] = {"documents": 1, "tokens": n,
                         "shards": [{"file": f"{split}_000.bin", "tokens": n}]}
    index = {"format": 1, "fingerprint": "markov", "source": "synthetic", "tokenizer": "none",
             "vocab_size": VOCAB, "eos_id": 0, "dtype": "uint16", "splits": splits,
             "max_token_id": VOCAB - 1}
    (path / "index.json").write_text(json.dumps(index))


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, as torchrun gives each rank: on a busy 2-core machine a team
    of 2 spin-waits for a core and a small model runs several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def launch_env(**extra: str) -> dict[str, str]:
    """This environment, plus ``extra``, without a launcher's rank variables (pytest may
    itself run under one: a child would take them for its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    return {**env, **extra}


def run_script(script: Path | str, *args: str, nproc: int = 1, cwd: Path,
               timeout: float = 600, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    """``script args`` in ``nproc`` processes (torchrun --standalone for more than one,
    plain python for one), each with one OpenMP thread as torchrun gives each rank: on a
    busy 2-core machine an OpenMP team of 2 spin-waits for a core and a 10-second run
    takes minutes. ``env``: more variables. On a timeout the launcher and every process
    under it are killed (``kill_tree``) before TimeoutExpired is raised."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return _communicate([sys.executable, *(launcher if nproc > 1 else []), str(script), *args],
                        cwd, timeout, env)


def run_ranks(script: Path | str, *args: str, nproc: int, cwd: Path, timeout: float = 600,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A test worker's ``main()`` on ``nproc`` ranks forked from one process that imported
    it (tests/forked_ranks.py: one import of torch and the project, not one per rank plus
    torchrun's); otherwise as ``run_script``. For workers, not for train.py's launch path."""
    return _communicate([sys.executable, str(HERE / "forked_ranks.py"), str(nproc),
                         str(script), *args], cwd, timeout, env)


def _communicate(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None
                 ) -> subprocess.CompletedProcess:
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=launch_env(OMP_NUM_THREADS="1", **(env or {})),
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process under it. torchrun's agent starts
    each rank in a session of its own, so killing the launcher's group alone (or the
    launcher) leaves the ranks running: they are found under it first, then killed."""
    below = descendants(pid)
    for target in (pid, *below):
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(target, signal.SIGKILL) if target == pid else os.kill(target,
                                                                              signal.SIGKILL)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until ``path`` exists, while ``proc`` runs; polled every 10 ms (a loop without a
    sleep takes one of CI's two cores from the process it waits for)."""
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.01)


def failed(proc: subprocess.CompletedProcess) -> str:
    """What to show when a launched process failed: the ends of its output."""
    return f"{proc.args} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def run_group(root: Path, common: list[str], nproc: int, layouts: dict[str, list[str]],
              eval_also: list[int] | tuple[int, ...] = ()) -> dict[str, dict]:
    """Run ``layouts`` one after the other with tests/parallel_worker.py, in one set of
    ``nproc`` processes (``run_ranks``: one start-up for all), or for one process in this
    one (which has already paid for importing torch); its records by name."""
    out = root / f"world{nproc}"
    out.mkdir()
    configs = compose_all({name: [*common, *overrides, "run_name=test"]
                           for name, overrides in layouts.items()})
    if nproc == 1:
        from parallel_worker import run_layout

        from pretrain.parallel.mesh import destroy

        with one_thread():
            for name, cfg in configs.items():
                run_layout(cfg, out, name, list(eval_also))
                destroy()  # the group of one a mixed-precision or offloaded run joined
    else:
        spec = write_spec(out / "spec.pkl", configs=configs, eval_also=list(eval_also))
        proc = run_ranks(HERE / "parallel_worker.py", str(out), str(spec), nproc=nproc,
                         cwd=root)
        assert proc.returncode == 0, failed(proc)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in layouts}


def read_metrics(run_dir: Path, pattern: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """Every row a run logged, in order, from the files matching ``pattern`` (sorted by
    name: ``metrics*.jsonl`` also reads the logs a rerun set aside); none if there are none."""
    return [json.loads(line) for path in sorted(run_dir.glob(pattern))
            for line in path.read_text().splitlines() if line.strip()]


def by_step(run_dir: Path, key: str = "loss", pattern: str = "metrics.jsonl") -> dict:
    """``{step: row[key]}`` over the training rows (those with a loss); a step logged twice
    (killed after logging, redone after a resume) keeps its last value."""
    return {m["step"]: m.get(key) for m in read_metrics(run_dir, pattern) if "loss" in m}


def read_result(run_dir: Path) -> dict[str, Any]:
    """The run's result.json."""
    return json.loads((run_dir / "result.json").read_text())
