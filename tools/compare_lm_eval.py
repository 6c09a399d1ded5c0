"""Same as the ``pretrain-compare-lm-eval`` command; the code is
src/pretrain/tools/compare_lm_eval.py."""

import sys

from pretrain.tools.compare_lm_eval import main

if __name__ == "__main__":
    sys.exit(main())
