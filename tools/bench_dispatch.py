"""Same as the ``pretrain-bench-dispatch`` command; the code is
src/pretrain/tools/bench_dispatch.py."""

import sys

from pretrain.tools.bench_dispatch import main

if __name__ == "__main__":
    sys.exit(main())
