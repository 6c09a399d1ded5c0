"""The tokenizer of a preparation: a byte-level BPE trained on a bounded sample of the
corpus, or a named Hugging Face tokenizer; saved as tokenizer.json for the encoders.

Training BPE on all of a large corpus costs minutes and gigabytes for a vocabulary that a
sample of a hundred MB or so already determines; the sample is the start of every piece in
proportion to its size, so it is spread over the whole corpus, and it leaves out the
validation documents (the same rule as the encoders apply), so validation text stays unseen.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pretrain.config.schema import DataConfig
from pretrain.data.errors import DataError
from pretrain.data.sources import iter_documents
from pretrain.data.split import ValidationRule

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
# The smallest byte-level BPE: the 256 bytes and EOS, no merges. ``tokenizer_vocab_size=257``
# tokenizes bytes (recipes/ladder-bytes.yaml: small widths keep their parameters in the body).
BYTE_VOCAB = 257


def sample_documents(cfg: DataConfig, pieces: list[dict]) -> tuple[list[str], int]:
    """Training documents, about cfg.tokenizer_sample_bytes of them (characters, counted as
    bytes), from the start of each piece in proportion to its share of the corpus; and
    their total size. Small corpora are read whole."""
    sizes = [p["bytes"] if p["bytes"] is not None else 1 for p in pieces]
    total = sum(sizes) or 1
    texts: list[str] = []
    taken, cum = 0, 0
    for i, (piece, size) in enumerate(zip(pieces, sizes, strict=True)):
        cum += size
        target = cfg.tokenizer_sample_bytes * cum / total
        if taken >= target:
            continue
        rule = ValidationRule(cfg.validation_fraction, cfg.seed, i)
        for doc in iter_documents(piece, cfg):
            if not doc or not doc.strip() or rule.next():
                continue
            texts.append(doc)
            taken += len(doc)
            if taken >= target:
                break
    return texts, taken


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained with HF tokenizers."""
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


def make_tokenizer(cfg: DataConfig, pieces: list[dict]) -> tuple[object, int, int]:
    """(backend ``tokenizers.Tokenizer``, vocabulary size, EOS id) for cfg.tokenizer."""
    if cfg.tokenizer == "bpe":
        if cfg.tokenizer_sample_bytes <= 0:
            raise DataError("data.tokenizer_sample_bytes must be positive")
        if cfg.tokenizer_vocab_size < BYTE_VOCAB:
            raise DataError(f"data.tokenizer_vocab_size={cfg.tokenizer_vocab_size}: a byte-level "
                            "BPE holds at least the 256 bytes and the end-of-document token; "
                            f"{BYTE_VOCAB} is bytes (no merges): data.tokenizer_vocab_size="
                            f"{BYTE_VOCAB} model.vocab_size={BYTE_VOCAB}")
        t0 = time.time()
        texts, size = sample_documents(cfg, pieces)
        if not texts:
            raise DataError(f"data.source={cfg.source!r} has no documents (or only validation "
                            "ones); check data.data_files and data.validation_fraction")
        log.info("data: training a byte-level BPE of %d tokens on a sample of %d documents "
                 "(%.1f MB, read in %.1f s)", cfg.tokenizer_vocab_size, len(texts), size / 1e6,
                 time.time() - t0)
        t0 = time.time()
        tok = train_bpe(texts, cfg.tokenizer_vocab_size)
        log.info("data: tokenizer trained in %.1f s", time.time() - t0)
        return tok, tok.get_vocab_size(), tok.token_to_id(EOS)
    if cfg.tokenizer.endswith(".json"):
        return tokenizer_file(cfg.tokenizer)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(cfg.tokenizer)
    except Exception as e:
        raise DataError(
            f"could not load data.tokenizer={cfg.tokenizer!r}: {e}. Without hub access "
            "use data.tokenizer=bpe (trained on the corpus) or a local tokenizer directory."
        ) from e
    if not getattr(hf, "is_fast", False):
        raise DataError(f"tokenizer {cfg.tokenizer!r} has no fast (Rust) version to encode with")
    if hf.eos_token_id is None:
        raise DataError(f"tokenizer {cfg.tokenizer!r} has no EOS token to separate documents")
    return hf.backend_tokenizer, len(hf), hf.eos_token_id


def tokenizer_file(name: str) -> tuple[object, int, int]:
    """data.tokenizer=path/to/tokenizer.json: a tokenizer saved by another preparation (the
    way a mixture's sources share one vocabulary, docs/mixtures.md)."""
    from tokenizers import Tokenizer

    if not Path(name).is_file():
        raise DataError(f"data.tokenizer={name} is no file; name a tokenizer.json (e.g. "
                        "<data.root>/<a prepared corpus>/tokenizer.json), bpe, or a hub name")
    tok = Tokenizer.from_file(name)
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise DataError(f"data.tokenizer={name} has no {EOS} token to separate documents")
    return tok, tok.get_vocab_size(), eos


def load_for_encoding(path: Path):
    """tokenizer.json as the encoders use it: no truncation or padding, whatever was saved."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    return tok


def check_document_token(model, index: dict, path) -> None:
    """Under model.attention_mask=document, the model's end-of-document id must be the one
    the preparation put between documents (index.json's eos_id), or windows would be cut
    at the wrong token: an error naming the fix, before any work."""
    if model.attention_mask != "document" or index.get("eos_id") is None:
        return
    if model.eod_id != index["eos_id"]:
        raise DataError(
            f"model.attention_mask=document ends documents at model.eod_id={model.eod_id}, "
            f"but the data in {path} separates documents with token {index['eos_id']} "
            f"({index.get('tokenizer', 'its tokenizer')}'s {EOS}): set "
            f"model.eod_id={index['eos_id']}")
