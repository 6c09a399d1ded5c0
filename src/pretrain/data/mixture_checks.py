"""The config checks of a mixture (``data=mixture``): its sources, weights, stages and
cooldown mix as keys, before anything is read (decision/checks.py lists them with the
others; source_checks.py checks the prepared sources on disk)."""

from __future__ import annotations

from pretrain.config.schema import DataConfig
from pretrain.data.sources import LOCAL_FORMATS

# The single-source keys a mixture leaves at data=mixture's values (conf/data/mixture.yaml).
SINGLE_SOURCE = {"name": "mixture", "source": "mixture", "subset": None, "revision": None,
                 "data_files": [], "roots": [], "max_documents": None, "tokens": None}
# An entry's preparation keys (mixture_prepare.py) that mean nothing without its source.
ENTRY_KEYS = ("subset", "revision", "data_files", "roots", "text_field", "max_documents",
              "validation_fraction")


def empty_mixture_problem() -> str:
    """data=mixture with no sources: the one line that says so, and the fix."""
    return ("data.mixture is empty: data=mixture trains on the sources data.mixture lists; "
            "list them, e.g. 'data.mixture=[{name: stdlib, weight: 0.7, source: stdlib}, "
            "{name: docs, weight: 0.3, source: local-docs}]', or pick one corpus with "
            "data=<name> (docs/mixtures.md)")


def is_empty_mixture(cfg: DataConfig) -> bool:
    """data=mixture with an empty data.mixture (its single-source keys name no corpus)."""
    return not cfg.mixture and cfg.source == SINGLE_SOURCE["source"]


def _weights_problems(key: str, weights: dict[str, float], names: list[str]) -> list[str]:
    p = []
    unknown = [n for n in weights if n not in names]
    if unknown:
        p.append(f"{key} names {unknown}, not sources of data.mixture ({names}); use those "
                 "names (a source not listed gets weight 0)")
    if any(w < 0 for w in weights.values()):
        p.append(f"{key}={dict(weights)} has a negative weight; weights are shares >= 0")
    elif sum(weights.get(n, 0.0) for n in names) <= 0:
        p.append(f"{key}={dict(weights)} gives no source a positive weight; give at least "
                 "one source of data.mixture a weight > 0 (0 = validation only)")
    return p


def mixture_problems(cfg: DataConfig, decay: str) -> list[str]:
    """The config problems of a mixture (decision/checks.py lists them with the others);
    ``decay``: schedule.decay."""
    if not cfg.mixture:
        if is_empty_mixture(cfg):  # data=mixture, nothing listed: nothing to read at all
            return [empty_mixture_problem()]
        extra = [k for k in ("stages", "cooldown_weights") if getattr(cfg, k)]
        return [f"data.{k} needs data.mixture (a list of {{name, weight}} sources)"
                for k in extra]
    names = [s.name for s in cfg.mixture]
    p = [f"data.{k}={getattr(cfg, k)!r} is a single-source key: a mixture reads its sources' "
         f"prepared corpora; use data=mixture and leave data.{k} at {v!r} (each source "
         "is prepared on its own: docs/mixtures.md)"
         for k, v in SINGLE_SOURCE.items() if getattr(cfg, k) != v]
    if "" in names or len(set(names)) != len(names):
        p.append(f"data.mixture's names {names} must be distinct corpus names under data.root")
    p += _weights_problems("data.mixture", {s.name: s.weight for s in cfg.mixture}, names)
    p += [f"data.mixture[{i}] ({s.name}) sets {keys} but no source: add `source:` (how "
          "the one-job preparation builds it: stdlib, site-packages, local-docs, text, json, "
          "parquet or a hub name) or remove them (docs/mixtures.md)"
          for i, s in enumerate(cfg.mixture)
          if s.source is None and (keys := [k for k in ENTRY_KEYS
                                            if getattr(s, k, None) not in (None, [])])]
    p += [f"data.mixture[{i}] ({s.name}) has source={s.source}, which reads local files, "
          f"but no data_files; set data.mixture[{i}].data_files=[path/to/file, ...] (globs "
          "allowed)" for i, s in enumerate(cfg.mixture)
          if s.source in LOCAL_FORMATS and not s.data_files]
    steps = [int(st.step) for st in cfg.stages]
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)) or any(s < 0 for s in steps):
        p.append(f"data.stages steps {steps} must be >= 0 and strictly increasing: each "
                 "stage's weights apply from its step to the next stage's")
    for i, st in enumerate(cfg.stages):
        p += _weights_problems(f"data.stages[{i}].weights", dict(st.weights), names)
    if cfg.cooldown_weights:
        p += _weights_problems("data.cooldown_weights", dict(cfg.cooldown_weights), names)
        if decay != "wsd":
            p.append(f"data.cooldown_weights applies from a WSD schedule's decay start: use "
                     f"schedule=wsd (not decay={decay}), or data.stages with a step")
    return p
