"""A mixture prepared as one job: every source of ``data.mixture`` that says how it is built
(``source`` and its keys) and is not prepared yet, with one shared tokenizer.

    python tools/prepare_data.py +recipe=mixture-local

The tokenizer: ``data.tokenizer`` when it names one (a hub name or a tokenizer.json path);
for ``bpe``, the tokenizer.json of the first source already prepared, else the first source
to prepare trains the BPE and the others reuse its tokenizer.json. Each source is the
ordinary single-source preparation (prepare.py: plan, encode, merge, resumable) of the
data config the entry makes: data's keys, the entry's name, and the entry's own keys where
set. A source already prepared is used as it is and never rewritten (its settings differing
from the entry's is a warning; its tokenizer differing from the others' an error before any
work). Entries without ``source`` must be prepared already (docs/mixtures.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from pretrain.config.schema import DataConfig
from pretrain.data.errors import DataError
from pretrain.data.prepare import INDEX, config_dict, data_dir, fingerprint, load_index, prepare
from pretrain.data.source_checks import check_sources, missing_file_problems, tokenizer_problem

log = logging.getLogger(__name__)
# The keys of a mixture entry that describe how to prepare it (config/schema.py MixtureSource).
PREP_KEYS = ("source", "subset", "revision", "data_files", "roots", "text_field",
             "max_documents", "validation_fraction")
MIXTURE_ONLY = ("mixture", "stages", "cooldown_weights")


def source_config(cfg: DataConfig, i: int, tokenizer: str) -> DataConfig:
    """The single-source data config that prepares ``data.mixture[i]``."""
    base = {k: v for k, v in config_dict(cfg).items() if k not in MIXTURE_ONLY}
    entry = (
        config_dict(cfg.mixture[i])
        if not isinstance(cfg.mixture[i], dict)
        else dict(cfg.mixture[i])
    )
    base.update({k: entry[k] for k in PREP_KEYS if entry.get(k) not in (None, [])})
    base.update(name=entry["name"], tokenizer=tokenizer)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    return DataConfig(**{k: v for k, v in base.items() if k in fields})


def _prepared(cfg: DataConfig) -> list[bool]:
    return [(Path(cfg.root) / s.name / INDEX).exists() for s in cfg.mixture]


def _problems(cfg: DataConfig, prepared: list[bool]) -> list[str]:
    """What stops the job before any work: a source neither prepared nor preparable, local
    files that are not there, and prepared sources that disagree on the tokenizer."""
    p = [f"data.mixture[{i}].name={s.name}: no prepared data at {Path(cfg.root) / s.name} "
         f"and no source to prepare it from; add `source:` (and its keys) to the entry, or "
         f"prepare it on its own (docs/mixtures.md)"
         for i, (s, done) in enumerate(zip(cfg.mixture, prepared, strict=True))
         if not done and s.source is None]
    done = [(s.name, Path(cfg.root) / s.name) for s, ok in zip(cfg.mixture, prepared,
                                                              strict=True) if ok]
    p += missing_file_problems(cfg)
    problem = tokenizer_problem([(n, path, load_index(path)) for n, path in done])
    return p + ([problem] if problem else [])


def shared_tokenizer(cfg: DataConfig, prepared: list[bool]) -> str | None:
    """The tokenizer every source is prepared with (None: the first one trains a BPE)."""
    if cfg.tokenizer != "bpe":
        return cfg.tokenizer
    first = next((s.name for s, ok in zip(cfg.mixture, prepared, strict=True) if ok), None)
    return None if first is None else str(Path(cfg.root) / first / "tokenizer.json")


def _warn_if_other_settings(cfg: DataConfig, i: int, tokenizer: str | None) -> None:
    """A prepared source is used as it is; say so when the entry now describes another."""
    if cfg.mixture[i].source is None:
        return
    have = load_index(data_dir(source_config(cfg, i, "bpe"))).get("fingerprint")
    wants = {fingerprint(source_config(cfg, i, t)) for t in {cfg.tokenizer, tokenizer} if t}
    if have not in wants:
        log.warning("data.mixture[%d].name=%s: %s was prepared with other settings than the "
                    "entry's; it is used as it is (delete it to prepare it again)", i,
                    cfg.mixture[i].name, Path(cfg.root) / cfg.mixture[i].name)


def prepare_mixture(cfg: DataConfig, workers: int | None = None) -> list[dict]:
    """Prepare the sources not prepared yet; per source: name, dir, tokens per split, the
    bytes of its inputs, seconds, and whether this call prepared it (``prepared_now``)."""
    prepared = _prepared(cfg)
    problems = _problems(cfg, prepared)
    if problems:
        raise DataError("the mixture cannot be prepared:\n" +
                        "\n".join(f"  - {p}" for p in problems))
    tokenizer = shared_tokenizer(cfg, prepared)
    summary = []
    for i, entry in enumerate(cfg.mixture):
        t0 = time.time()
        if prepared[i]:
            _warn_if_other_settings(cfg, i, tokenizer)
            out = Path(cfg.root) / entry.name
            log.info("data: mixture source %s: %s is prepared, used as it is", entry.name, out)
        else:
            log.info("data: mixture source %s (%d of %d): preparing, tokenizer %s",
                     entry.name, i + 1, len(cfg.mixture), tokenizer or "bpe (trained here)")
            out = prepare(source_config(cfg, i, tokenizer or "bpe"), workers)
            tokenizer = tokenizer or str(out / "tokenizer.json")
        summary.append({**_summary(entry.name, out, time.time() - t0),
                        "prepared_now": not prepared[i]})
    check_sources(cfg)
    return summary


def _summary(name: str, out: Path, seconds: float) -> dict:
    index = load_index(out)
    plan = out / "plan.json"
    size = json.loads(plan.read_text()).get("bytes") if plan.exists() else None
    return {"name": name, "dir": str(out), "bytes": size, "seconds": round(seconds, 1),
            "tokens": {s: v["tokens"] for s, v in index["splits"].items()}}


def needs_mixture_preparation(cfg: DataConfig) -> bool:
    """A mixture with a source that says how it is built and is not prepared yet."""
    return bool(cfg.mixture) and cfg.auto_prepare and any(
        s.source is not None and not ok for s, ok in zip(cfg.mixture, _prepared(cfg),
                                                         strict=True))
