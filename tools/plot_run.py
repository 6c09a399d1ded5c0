"""Same as the ``pretrain-plot-run`` command; the code is src/pretrain/tools/plot_run.py."""
import sys

from pretrain.tools.plot_run import main

if __name__ == "__main__":
    sys.exit(main())
