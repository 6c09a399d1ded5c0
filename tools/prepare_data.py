"""Tokenize a dataset into flat token shards once, ahead of training.

    python tools/prepare_data.py                       # the embedded corpus (data=stdlib)
    python tools/prepare_data.py data=tinystories      # a hub dataset (needs hub access)
    python tools/prepare_data.py data=local-text 'data.data_files=[corpus/*.txt]'
    python tools/prepare_data.py +recipe=gpt2-124m     # whatever a recipe trains on

Takes the same overrides as train.py and writes to <data.root>/<data.name>/ exactly what
training would prepare on first use. Running it again reuses finished work.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pretrain.cli import compose_config  # noqa: E402
from pretrain.data.prepare import DataError, prepare  # noqa: E402


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = compose_config(argv)
    try:
        out = prepare(cfg.data)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    index = json.loads((out / "index.json").read_text())
    summary = {split: v["tokens"] for split, v in index["splits"].items()}
    print(json.dumps({"dir": str(out), "vocab_size": index["vocab_size"], "tokens": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
