"""Same as the ``pretrain-run-local`` command; the code is src/pretrain/tools/run_local.py."""
import sys

from pretrain.tools.run_local import main

if __name__ == "__main__":
    sys.exit(main())
