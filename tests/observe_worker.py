"""One training run (trainer.run) of a composed config, in each rank:
``python tests/forked_ranks.py N tests/observe_worker.py SPEC`` (helpers.run_ranks) or
``torchrun --nproc_per_node=N tests/observe_worker.py SPEC`` (SPEC: helpers.write_spec's
file, {"cfg": Config, "run_dir": path}). The log at INFO on stderr, as train.py's is."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from helpers import read_spec

from pretrain.train.trainer import run


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    spec = read_spec(sys.argv[1])
    result = run(spec["cfg"], Path(spec["run_dir"]))
    sys.exit(result.get("exit_code", 0) if result else 0)


if __name__ == "__main__":
    main()
