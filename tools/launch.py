"""Same as the ``pretrain-launch`` command; the code is src/pretrain/tools/launch.py."""
import sys

from pretrain.tools.launch import main

if __name__ == "__main__":
    sys.exit(main())
