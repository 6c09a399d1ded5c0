"""Same as the ``pretrain-plan`` command; the code is src/pretrain/tools/plan.py."""
import sys

from pretrain.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
