"""Encode pieces of a planned preparation into token shards: the worker of the encode stage.

Piece i becomes ``train_<i>.bin`` and ``validation_<i>.bin`` (``-1``, ``-2`` ... after them
when a split of the piece exceeds data.shard_tokens), token ids written straight to uint16 or
uint32 files, documents ended by EOS, and the UTF-8 bytes of each split's text (its
documents, the EOS tokens not counted: bits per byte divide by these); then the marker
``done/<i>.json`` (its counts), written
last and atomically, so a piece is either finished or encoded again. Worker k of n takes the
pieces i with i % n == k, so the files do not depend on n.

Run alone (by the local job for each worker process) as::

    python -m pretrain.data.encode STAGING_DIR K N [--progress FILE]
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from pretrain.config.schema import DataConfig
from pretrain.data.errors import DataError
from pretrain.data.sources import iter_documents
from pretrain.data.split import ValidationRule
from pretrain.data.tokenizer import load_for_encoding

log = logging.getLogger(__name__)

PLAN = "plan.json"
DONE = "done"
# Documents are encoded in batches of about this many characters: big enough for the
# tokenizer's threads, small enough that its per-token objects stay in the tens of MB.
BATCH_CHARS = 2 << 20
PROGRESS_EVERY_S = 5.0


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def done_path(staging: Path, i: int) -> Path:
    return staging / DONE / f"{i:05d}.json"


def shard_name(split: str, piece: int, part: int) -> str:
    return f"{split}_{piece:03d}.bin" if part == 0 else f"{split}_{piece:03d}-{part}.bin"


class ShardWriter:
    """Token ids of one split of one piece, to files of at most shard_tokens tokens."""

    def __init__(self, staging: Path, split: str, piece: int, dtype, shard_tokens: int):
        self.staging, self.split, self.piece = staging, split, piece
        self.dtype, self.shard_tokens = np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.documents = 0
        self.text_bytes = 0  # UTF-8 bytes of the documents' text, the EOS tokens not counted
        self._file = None
        self._n = 0

    def _tmp(self) -> Path:
        return self.staging / f".{shard_name(self.split, self.piece, len(self.shards))}.tmp"

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._file is None:
                self._file = open(self._tmp(), "wb")
            take = min(len(ids), self.shard_tokens - self._n)
            ids[:take].tofile(self._file)
            self._n += take
            ids = ids[take:]
            if self._n >= self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())  # on disk before the done-marker can say so
        self._file.close()
        name = shard_name(self.split, self.piece, len(self.shards))
        os.replace(self._tmp(), self.staging / name)
        self.shards.append({"file": name, "tokens": self._n})
        self._file, self._n = None, 0

    def close(self) -> dict:
        if self._file is not None:
            self._close_shard()
        return {"documents": self.documents, "tokens": sum(s["tokens"] for s in self.shards),
                "bytes": self.text_bytes, "shards": self.shards}


class Progress:
    """Bytes and tokens done; logged every few seconds and/or written to a file that the
    local job's parent sums over its workers."""

    def __init__(self, total_bytes: int | None, label: str, file: Path | None = None,
                 log_lines: bool = True):
        self.total, self.label, self.file, self.log_lines = total_bytes, label, file, log_lines
        self.bytes = self.tokens = self.skipped_bytes = 0
        self.t0 = self.last_file = self.last_log = time.time()

    def update(self, nbytes: int = 0, tokens: int = 0, force: bool = False) -> None:
        self.bytes += nbytes
        self.tokens += tokens
        now = time.time()
        if self.file is not None and (force or now - self.last_file >= 1.0):
            write_json_atomic(self.file, {"bytes": self.bytes, "tokens": self.tokens,
                                          "skipped_bytes": self.skipped_bytes})
            self.last_file = now
        if self.log_lines and (force or now - self.last_log >= PROGRESS_EVERY_S):
            log.info("%s", progress_line(self.label, self.bytes, self.skipped_bytes, self.tokens,
                                         self.total, now - self.t0))
            self.last_log = now


def progress_line(label: str, done: int, skipped: int, tokens: int, total: int | None,
                  elapsed: float) -> str:
    rate = tokens / max(elapsed, 1e-9)
    line = (
        f"{label}: {tokens / 1e6:,.1f}M tokens, {rate / 1e6:.2f}M tokens/s, "
        f"{(done + skipped) / 1e6:,.0f}"
    )
    if total:
        left = total - done - skipped
        eta = left * elapsed / done if done else float("nan")
        line += f"/{total / 1e6:,.0f} MB ({100 * (done + skipped) / total:.0f}%), ETA " + (
            f"{eta / 60:.1f} min" if eta == eta else "?"
        )
    else:
        line += " MB"
    return line


def encode_piece(staging: Path, plan: dict, i: int, tok, progress: Progress) -> dict:
    """Encode piece i into its shard files; return (and write) its done marker."""
    cfg = DataConfig(**plan["data"])
    dtype, eos = np.dtype(plan["dtype"]), plan["eos_id"]
    piece = plan["pieces"][i]
    splits = ["train", "validation"] if cfg.validation_fraction > 0 else ["train"]
    writers = {s: ShardWriter(staging, s, i, dtype, cfg.shard_tokens) for s in splits}
    batches: dict[str, list[str]] = {s: [] for s in splits}
    sizes = dict.fromkeys(splits, 0)
    rule = ValidationRule(cfg.validation_fraction, cfg.seed, i)
    max_id = -1
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def flush(split: str) -> None:
        nonlocal max_id
        docs = batches[split]
        if not docs:
            return
        ids = [e.ids for e in encode(docs, add_special_tokens=False)]
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        out = np.empty(int(lengths.sum()), dtype=dtype)
        ends = np.cumsum(lengths)
        start = 0
        for x, end in zip(ids, ends, strict=True):
            out[start:end - 1] = x
            start = end
        out[ends - 1] = eos
        max_id = max(max_id, int(out.max()))
        writers[split].write(out)
        writers[split].documents += len(docs)
        writers[split].text_bytes += sum(len(d.encode("utf-8")) for d in docs)
        progress.update(sizes[split], len(out))
        batches[split], sizes[split] = [], 0

    chars = 0
    for doc in iter_documents(piece, cfg):
        if not doc or not doc.strip():
            continue
        split = "validation" if rule.next() else "train"
        batches[split].append(doc)
        sizes[split] += len(doc)
        chars += len(doc)
        if sizes[split] >= BATCH_CHARS:
            flush(split)
    for s in splits:
        flush(s)
    # Progress counted characters; make the piece count as exactly its bytes on disk.
    if piece.get("bytes"):
        progress.update(piece["bytes"] - chars, 0)
    marker = {"piece": i, "bytes": piece.get("bytes"), "max_token_id": max_id,
              "splits": {s: w.close() for s, w in writers.items()}}
    write_json_atomic(done_path(staging, i), marker)
    return marker


def load_plan(staging: Path) -> dict:
    path = staging / PLAN
    if not path.exists():
        raise DataError(f"{staging} has no {PLAN}: run the plan stage first "
                        "(python tools/prepare_data.py <same overrides> --stage plan)")
    return json.loads(path.read_text())


def my_pieces(plan: dict, task: int, of: int) -> list[int]:
    if of < 1 or not 0 <= task < of:
        raise DataError(f"--task {task} --of {of}: need 0 <= task < of")
    return [i for i in range(len(plan["pieces"])) if i % of == task]


def run_worker(staging: Path, task: int, of: int, progress_file: Path | None = None,
               log_lines: bool = True) -> dict:
    """Encode this worker's pieces that are not done yet; a summary of what it did."""
    staging = Path(staging)
    plan = load_plan(staging)
    (staging / DONE).mkdir(exist_ok=True)
    mine = my_pieces(plan, task, of)
    todo = [i for i in mine if not done_path(staging, i).exists()]
    sizes = [plan["pieces"][i].get("bytes") for i in mine]
    total = sum(sizes) if None not in sizes else None
    progress = Progress(total, f"encode {task}/{of}", progress_file, log_lines)
    progress.skipped_bytes = sum(plan["pieces"][i].get("bytes") or 0 for i in mine
                                 if i not in todo)
    if len(todo) < len(mine):
        log.info("encode %d/%d: %d of its %d pieces already done, skipped", task, of,
                 len(mine) - len(todo), len(mine))
    tok = load_for_encoding(staging / "tokenizer.json") if todo else None
    for i in todo:
        encode_piece(staging, plan, i, tok, progress)
    progress.update(force=True)
    return {"task": task, "of": of, "pieces": len(mine), "encoded": len(todo),
            "tokens": progress.tokens}


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description="encode one worker's pieces (see module doc)")
    p.add_argument("staging", type=Path)
    p.add_argument("task", type=int)
    p.add_argument("of", type=int)
    p.add_argument("--progress", type=Path, default=None)
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        run_worker(args.staging, args.task, args.of, args.progress, not args.quiet)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
