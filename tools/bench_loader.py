"""Same as the ``pretrain-bench-loader`` command; the code is src/pretrain/tools/bench_loader.py."""
import sys

from pretrain.tools.bench_loader import main

if __name__ == "__main__":
    sys.exit(main())
