"""Same as the ``pretrain-bench-gpu`` command; the code is src/pretrain/tools/bench_gpu.py."""
import sys

from pretrain.tools.bench_gpu import main

if __name__ == "__main__":
    sys.exit(main())
