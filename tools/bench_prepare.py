"""Same as the ``pretrain-bench-prepare`` command; the code is
src/pretrain/tools/bench_prepare.py."""

import sys

from pretrain.tools.bench_prepare import main

if __name__ == "__main__":
    sys.exit(main())
