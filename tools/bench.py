"""Same as the ``pretrain-bench`` command; the code is src/pretrain/tools/bench.py."""
import sys

from pretrain.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
