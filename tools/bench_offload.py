"""Same as the ``pretrain-bench-offload`` command; the code is
src/pretrain/tools/bench_offload.py."""

import sys

from pretrain.tools.bench_offload import main

if __name__ == "__main__":
    sys.exit(main())
