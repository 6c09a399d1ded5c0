"""Where the checkout's own files are: the one place that knows this package sits in
``<checkout>/src/pretrain`` (an editable install, as README.md sets up). The tools read
the checkout's conf/, slurm/ templates, train.py and tools/, which are not in the package."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2]  # <checkout>/src: the package's import root
REPO = SRC.parent  # the checkout
CONF_DIR = REPO / "conf"  # Hydra's config groups: model/, precision/, gpu/, ...
