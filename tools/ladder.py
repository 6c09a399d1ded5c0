"""A WSD ladder, its cooldown branches and the fit in one command; the code is
src/pretrain/tools/ladder.py."""
import sys

from pretrain.tools.ladder import main

if __name__ == "__main__":
    sys.exit(main())
