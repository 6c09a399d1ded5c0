"""Same as the ``pretrain-bench-checkpoint`` command; the code is
src/pretrain/tools/bench_checkpoint.py."""

import sys

from pretrain.tools.bench_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
