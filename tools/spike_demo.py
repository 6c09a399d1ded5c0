"""The code is src/pretrain/tools/spike_demo.py."""
import sys

from pretrain.tools.spike_demo import main

if __name__ == "__main__":
    sys.exit(main())
