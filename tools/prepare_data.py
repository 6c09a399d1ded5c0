"""Same as the ``pretrain-prepare`` command; the code is src/pretrain/tools/prepare_data.py."""
import sys

from pretrain.tools.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
