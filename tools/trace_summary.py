"""Same as the ``pretrain-trace-summary`` command; the code is
src/pretrain/tools/trace_summary.py."""

import sys

from pretrain.tools.trace_summary import main

if __name__ == "__main__":
    sys.exit(main())
