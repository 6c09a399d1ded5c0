"""Check the committed ladder (docs/ladder/): re-predict, compare a rerun rung, export runs;
the code is src/pretrain/tools/ladder_check.py."""
import sys

from pretrain.tools.ladder_check import main

if __name__ == "__main__":
    sys.exit(main())
