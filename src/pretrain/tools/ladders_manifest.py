"""The published ladders of docs/ladder/published/ladders.toml: each entry's table, the flags
of tools/scaling_law.py that choose its fit set, and its held-out runs (issue 68; the schema
is in the manifest's header)."""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pretrain.analysis.runs import RunPoint, read_points
from pretrain.config.paths import REPO

PUBLISHED = REPO / "docs" / "ladder" / "published"
MANIFEST = PUBLISHED / "ladders.toml"


@dataclass(frozen=True)
class Entry:
    """One ladder of the manifest."""

    name: str
    table: str
    design: str
    flags: tuple[str, ...]
    heldout: tuple[str, ...]
    paper_error: str = ""
    optimal: tuple[tuple[float, str], ...] = ()   # (budget, the held-out best run there)

    def args(self) -> list[str]:
        """tools/scaling_law.py's arguments for this ladder (without --policy)."""
        held = [x for h in self.heldout for x in ("--heldout", re.escape(h))]
        return ["--points", str(PUBLISHED / self.table), *self.flags, *held]


def read_manifest(path: Path = MANIFEST) -> dict[str, Entry]:
    """The manifest's ladders by name, in its order."""
    data = tomllib.loads(path.read_text())
    return {d["name"]: Entry(d["name"], d["table"], d.get("design", ""), tuple(d["flags"]),
                             tuple(d["heldout"]), d.get("paper_error", ""),
                             tuple((float(o["budget"]), o["run"])
                                   for o in d.get("optimal", ())))
            for d in data["ladder"]}


def ladder_and_targets(entry: Entry | str) -> tuple[list[RunPoint], list[RunPoint]]:
    """(the runs the ladder may fit, its held-out runs), selected as tools/scaling_law.py
    selects them from the entry's flags."""
    from pretrain.tools.fit_policy import add_arguments, select

    if isinstance(entry, str):
        entry = read_manifest()[entry]
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args, _ = ap.parse_known_args(list(entry.args()[2:]))
    return select(read_points(PUBLISHED / entry.table), args)
