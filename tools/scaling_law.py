"""Same as the ``pretrain-scaling-law`` command; the code is src/pretrain/tools/scaling_law.py."""
import sys

from pretrain.tools.scaling_law import main

if __name__ == "__main__":
    sys.exit(main())
