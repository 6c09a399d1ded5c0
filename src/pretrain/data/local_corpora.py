"""Corpora that every machine with this project installed holds: builders of file lists
beside the embedded ``stdlib`` one (data.source=<name>, one document per file).

    site-packages   the .py sources of the running interpreter's installed packages
                    (sysconfig's purelib and platlib: the project's own dependencies)
    local-docs      text documentation: *.md, *.rst, *.txt under those site-packages, the
                    Python installation (sys.base_prefix) and /usr/share/doc when present

``data.roots`` replaces the default directories (a test points them at a tmp dir). Package
metadata (``*.dist-info``, ``*.egg-info``), caches and files over ``MAX_FILE_BYTES``
(generated tables: unicode data, vendored minified code, changelog dumps) are left out.
The list is sorted and de-duplicated by real path, so it depends only on the files.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from pretrain.config.schema import DataConfig
from pretrain.data.errors import DataError

MAX_FILE_BYTES = 1_000_000
SKIP_DIRS = {"__pycache__", ".git", "node_modules"}
SKIP_SUFFIXES = (".dist-info", ".egg-info")
DOC_SUFFIXES = {".md", ".rst", ".txt"}


def _site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def default_roots(source: str) -> list[str]:
    """The directories ``source`` reads on this machine when data.roots is empty."""
    if source == "site-packages":
        return _site_packages()
    docs = [*_site_packages(), sys.base_prefix, "/usr/share/doc"]
    return [d for d in dict.fromkeys(docs) if Path(d).is_dir()]


def roots(cfg: DataConfig) -> list[str]:
    return [os.path.abspath(os.path.expanduser(r)) for r in cfg.roots] or default_roots(cfg.source)


def _walk(root: str, suffixes: set[str]) -> list[str]:
    found = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(SKIP_SUFFIXES)]
        found += [os.path.join(dirpath, n) for n in names if Path(n).suffix in suffixes]
    return found


def find_files(cfg: DataConfig) -> list[str]:
    """The corpus of data.source=site-packages|local-docs: its files, sorted, each once."""
    suffixes = {".py"} if cfg.source == "site-packages" else DOC_SUFFIXES
    dirs = roots(cfg)
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        raise DataError(f"data.roots {missing} are not directories; data.source={cfg.source} "
                        "searches directories (leave data.roots empty for this machine's)")
    seen: dict[str, str] = {}
    for d in dirs:
        for f in _walk(d, suffixes):
            real = os.path.realpath(f)
            if (
                real not in seen
                and os.path.isfile(real)
                and 0 < os.path.getsize(real) <= MAX_FILE_BYTES
            ):
                seen[real] = f
    if not seen:
        raise DataError(f"data.source={cfg.source} found no {sorted(suffixes)} files under "
                        f"{dirs}; set data.roots to directories that hold some")
    return sorted(seen)


BUILDERS = {"site-packages": find_files, "local-docs": find_files}
