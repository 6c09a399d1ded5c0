"""Same as the ``pretrain-evaluate`` command; the code is src/pretrain/tools/evaluate.py."""
import sys

from pretrain.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
