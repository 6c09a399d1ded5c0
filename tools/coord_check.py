"""Same as the ``pretrain-coord-check`` command; the code is src/pretrain/tools/coord_check.py."""
import sys

from pretrain.tools.coord_check import main

if __name__ == "__main__":
    sys.exit(main())
