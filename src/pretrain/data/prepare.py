"""Pre-tokenize a Hugging Face ``datasets`` source into flat token shards, once.

Output, in ``<data.root>/<data.name>/``::

    index.json          tokenizer, dtype, vocab, eos id, shards per split, fingerprint
    tokenizer.json      the tokenizer used (trained here for tokenizer=bpe, or copied)
    train_000.bin ...   uint16/uint32 token ids, documents joined by the EOS token
    validation_000.bin

The directory is built under a temporary name and renamed when complete, so an interrupted
preparation is never mistaken for a finished one; a finished one with the same fingerprint
is reused, and one with a different fingerprint is never overwritten.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import sysconfig
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pretrain.config import DataConfig

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
INDEX = "index.json"
FORMAT_VERSION = 1
# Parts of the standard library left out of the embedded corpus: the test suite is two
# thirds of its size; idlelib/lib2to3 are applications; encodings/ is mostly generated
# code-page tables that a small model would otherwise spend its capacity memorising.
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "encodings", "site-packages",
               "dist-packages"}


# DataConfig keys that do not change the prepared tokens.
NOT_CONTENT = ("num_proc", "root", "auto_prepare", "tokens", "max_epochs")


class DataError(ValueError):
    pass


def data_dir(cfg: DataConfig) -> Path:
    return Path(cfg.root) / cfg.name


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


def fingerprint(cfg: DataConfig) -> str:
    """What determines the shards' content; where they go, how many processes make them,
    the declared size and the epoch limit do not."""
    keys = {k: v for k, v in asdict(cfg).items() if k not in NOT_CONTENT}
    if cfg.source == "stdlib":
        keys["stdlib"] = sysconfig.get_paths()["stdlib"]
    for f in expand_files(cfg.data_files):
        st = Path(f).stat()
        keys.setdefault("file_stats", []).append([f, st.st_size, int(st.st_mtime)])
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_source(cfg: DataConfig):
    """The raw documents as a ``datasets.Dataset`` with one text column."""
    import datasets

    if cfg.source == "stdlib":
        files = stdlib_files()
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        ds = datasets.Dataset.from_dict({cfg.text_field: texts})
    elif cfg.source in ("text", "json", "csv", "parquet", "arrow"):
        if not cfg.data_files:
            raise DataError(
                f"data.source={cfg.source} reads local files but data.data_files is empty; "
                "set data.data_files=[path/to/file, ...]"
            )
        missing = [f for f in cfg.data_files if not expand_files([f])]
        if missing:
            raise DataError(f"data.data_files matches no file: {missing}; check the paths")
        kwargs = {"sample_by": "document"} if cfg.source == "text" else {}
        ds = datasets.load_dataset(cfg.source, data_files=expand_files(cfg.data_files),
                                   split="train", **kwargs)
    else:
        try:
            ds = datasets.load_dataset(cfg.source, cfg.subset, split=cfg.split,
                                       revision=cfg.revision)
        except Exception as e:  # hub unreachable, unknown name, gated dataset ...
            raise DataError(
                f"could not load data.source={cfg.source!r} (subset={cfg.subset}) from the "
                f"Hugging Face hub: {e}. On a machine without hub access, use local files "
                "(data.source=text|json|parquet data.data_files=[...]) or the embedded corpus "
                "(data=stdlib)."
            ) from e
    if cfg.text_field not in ds.column_names:
        raise DataError(
            f"data.text_field={cfg.text_field!r} is not a column of {cfg.source}; "
            f"columns are {ds.column_names}"
        )
    if cfg.max_documents is not None:
        ds = ds.select(range(min(cfg.max_documents, len(ds))))
    ds = ds.select_columns([cfg.text_field])
    # Empty documents (empty files, blank records) would add nothing but EOS tokens.
    ds = ds.filter(lambda t: bool(t and t.strip()), input_columns=cfg.text_field)
    if len(ds) == 0:
        raise DataError(f"data.source={cfg.source!r} has no documents; check data.data_files")
    return ds


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained with HF tokenizers on the training text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def get_tokenizer(cfg: DataConfig, train_texts, out: Path):
    """A ``PreTrainedTokenizerFast`` saved as out/tokenizer.json, and its EOS id."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if cfg.tokenizer == "bpe":
        log.info("training a byte-level BPE of %d tokens on the corpus", cfg.tokenizer_vocab_size)
        raw = train_bpe(train_texts, cfg.tokenizer_vocab_size)
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS)
    else:
        try:
            tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
        except Exception as e:
            raise DataError(
                f"could not load data.tokenizer={cfg.tokenizer!r}: {e}. Without hub access "
                "use data.tokenizer=bpe (trained on the corpus) or a local tokenizer directory."
            ) from e
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer {cfg.tokenizer!r} has no EOS token to separate documents")
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    return tok


def write_split(ds, split: str, out: Path, dtype, shard_tokens: int) -> list[dict]:
    """Concatenate the ``ids`` column into shards of at most shard_tokens tokens."""
    from tqdm.auto import tqdm

    shards: list[dict] = []
    buf: list[np.ndarray] = []
    n_buf = 0

    def flush() -> None:
        nonlocal buf, n_buf
        if n_buf == 0:
            return
        name = f"{split}_{len(shards):03d}.bin"
        np.concatenate(buf).astype(dtype).tofile(out / name)
        shards.append({"file": name, "tokens": int(n_buf)})
        buf, n_buf = [], 0

    for batch in tqdm(ds.iter(batch_size=1024), total=-(-len(ds) // 1024),
                      desc=f"writing {split}", unit="batch", leave=False):
        for ids in batch["ids"]:
            arr = np.asarray(ids, dtype=np.int64)
            while len(arr):
                take = min(len(arr), shard_tokens - n_buf)
                buf.append(arr[:take])
                n_buf += take
                arr = arr[take:]
                if n_buf >= shard_tokens:
                    flush()
    flush()
    return shards


def prepare(cfg: DataConfig) -> Path:
    """Prepare the shards for ``cfg`` unless an identical preparation exists. Returns the dir."""
    out = data_dir(cfg)
    fp = fingerprint(cfg)
    index_path = out / INDEX
    if index_path.exists():
        index = json.loads(index_path.read_text())
        if index.get("fingerprint") == fp:
            log.info("data: %s already prepared (%s tokens train), reusing", out,
                     f"{index['splits']['train']['tokens']:,}")
            return out
        raise DataError(
            f"{out} holds data prepared with different settings (fingerprint "
            f"{index.get('fingerprint')} != {fp}); it is not overwritten. Use another "
            f"data.name, or delete {out} to prepare it again."
        )
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out} exists but has no {INDEX}; it is not overwritten. "
                        f"Delete it or choose another data.name.")
    if not 0 <= cfg.validation_fraction < 1:
        raise DataError("data.validation_fraction must be in [0, 1)")

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        ds = load_source(cfg)
        log.info("data: %d documents from %s", len(ds), cfg.source)
        n_val = int(round(len(ds) * cfg.validation_fraction))
        if cfg.validation_fraction > 0:
            n_val = max(1, n_val)
        if n_val >= len(ds):
            raise DataError(f"data has {len(ds)} documents, too few for a validation split of "
                            f"{cfg.validation_fraction}; lower data.validation_fraction")
        parts = ds.train_test_split(test_size=n_val, seed=cfg.seed) if n_val else None
        splits = {"train": parts["train"], "validation": parts["test"]} if parts else {"train": ds}

        tok = get_tokenizer(cfg, (t for t in splits["train"][cfg.text_field]), tmp)
        vocab = len(tok)
        dtype = np.uint16 if vocab <= 65536 else np.uint32
        field_, eos = cfg.text_field, tok.eos_token_id

        def encode(batch):
            ids = tok(batch[field_], add_special_tokens=False)["input_ids"]
            return {"ids": [x + [eos] for x in ids]}

        index = {
            "format": FORMAT_VERSION, "fingerprint": fp, "source": cfg.source,
            "tokenizer": cfg.tokenizer, "vocab_size": vocab, "eos_id": eos,
            "dtype": np.dtype(dtype).name, "splits": {},
        }
        max_id = 0
        for split, part in splits.items():
            enc = part.map(encode, batched=True, num_proc=max(1, cfg.num_proc) if len(part) > 1 else None,
                           remove_columns=part.column_names, desc=f"tokenizing {split}")
            shards = write_split(enc, split, tmp, dtype, cfg.shard_tokens)
            for s in shards:
                max_id = max(max_id, int(np.fromfile(tmp / s["file"], dtype=dtype).max()))
            index["splits"][split] = {
                "documents": len(part), "tokens": sum(s["tokens"] for s in shards),
                "shards": shards,
            }
        index["max_token_id"] = max_id
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("data: prepared %s: %s", out, {k: v["tokens"] for k, v in index["splits"].items()})
    return out


def load_index(path: Path) -> dict:
    index_path = Path(path) / INDEX
    if not index_path.exists():
        raise DataError(
            f"no prepared data at {path} ({INDEX} missing); run "
            f"`python tools/prepare_data.py data=...` or set data.auto_prepare=true"
        )
    return json.loads(index_path.read_text())
