"""The data section of the schema (``data.*``): one corpus, or a weighted mixture of
prepared corpora with stages and a cooldown mix (docs/mixtures.md). Re-exported by
``pretrain.config.schema``, where users import it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MixtureSource:
    """One corpus of a mixture: prepared under ``${data.root}/${name}``, and its share of
    the training samples (0: validation only). See docs/mixtures.md."""

    name: str = ""
    weight: float = 1.0
    # How to prepare it (optional): with ``source`` set, ``tools/prepare_data.py`` given the
    # mixture (and a one-process run with data.auto_prepare) prepares the source when
    # ${data.root}/${name} holds no prepared data, with the mixture's one tokenizer; the
    # keys left unset take data's. Keys as data's own (docs/mixtures.md, "One job").
    source: str | None = None
    subset: str | None = None
    revision: str | None = None
    data_files: list[str] = field(default_factory=list)
    roots: list[str] = field(default_factory=list)
    text_field: str | None = None
    max_documents: int | None = None
    validation_fraction: float | None = None


@dataclass
class MixtureStage:
    """The mixture's weights from optimizer step ``step`` on (sources not listed: 0)."""

    step: int = 0
    weights: dict[str, float] = field(default_factory=dict)


@dataclass
class DataConfig:
    name: str = "stdlib"
    # Where the data comes from: "stdlib" (the embedded corpus: this Python's own standard
    # library sources), a Hugging Face hub dataset name, or a builder for local files
    # ("text", "json", "parquet") together with data_files.
    source: str = "stdlib"
    subset: str | None = None
    # A hub dataset's git revision (branch, tag or commit), e.g. "refs/convert/parquet" for
    # the Hub's Parquet copy of a dataset whose main branch holds a loading script.
    revision: str | None = None
    split: str = "train"
    data_files: list[str] = field(default_factory=list)
    # The directories the local-corpus builders (source=site-packages|local-docs,
    # data/local_corpora.py) search; empty: this machine's own (docs/mixtures.md).
    roots: list[str] = field(default_factory=list)
    text_field: str = "text"
    # Cap on documents read from the source (None = all); handy for huge hub corpora.
    max_documents: int | None = None
    # Tokenizer: a Hugging Face tokenizer name (e.g. "gpt2") or "bpe" to train a byte-level
    # BPE of tokenizer_vocab_size on the corpus, saved beside the shards as tokenizer.json.
    # tokenizer_vocab_size=257 is bytes: the 256 bytes and the end-of-document token, no
    # merges (a ladder's small widths keep their parameters in the body; recipes/ladder-bytes).
    tokenizer: str = "bpe"
    tokenizer_vocab_size: int = 4096
    validation_fraction: float = 0.02
    shard_tokens: int = 100_000_000
    num_proc: int = 2
    seed: int = 1234
    # Prepared shards live in ${root}/${name}; prepared on first use when auto_prepare.
    root: str = "data"
    auto_prepare: bool = True
    # The corpus's size in tokens of this tokenizer, as its card declares it (None: unknown
    # until prepared). Used for the epoch count before the data is prepared; once prepared,
    # the index's exact count is used instead.
    tokens: int | None = None
    # A budget that goes through the training split more often than this is a
    # configuration error (more than one epoch is a warning): repeated data stops paying
    # after about 4 epochs (Muennighoff et al. 2023).
    max_epochs: float = 4.0
    # Preparation cuts the corpus into pieces of about this many bytes (JSON Lines: newline-
    # aligned byte ranges; text/stdlib: groups of files; parquet: groups of row groups; hub:
    # its data files), each encoded alone into its own shards, so the output does not depend
    # on the number of workers (num_proc: the local default; or --workers / --of). Changing
    # it re-prepares.
    piece_bytes: int = 64_000_000
    # tokenizer=bpe is trained on at most this much text (characters), taken from the start of
    # every piece in proportion to its size, validation documents left out.
    tokenizer_sample_bytes: int = 64_000_000
    # A weighted mixture of prepared corpora (data=mixture; src/pretrain/data/mixer.py,
    # docs/mixtures.md): every global batch holds each source's share to within one sample.
    # stages: new weights from a step on; cooldown_weights: from a WSD run's decay start on
    # (a cooldown branch may set its own). Empty mixture: the single corpus data.name
    # (data=mixture itself with an empty list is refused: it names no corpus).
    mixture: list[MixtureSource] = field(default_factory=list)
    stages: list[MixtureStage] = field(default_factory=list)
    cooldown_weights: dict[str, float] = field(default_factory=dict)
