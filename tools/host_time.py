"""Same as the ``pretrain-host-time`` command; the code is src/pretrain/tools/host_time.py."""
import sys

from pretrain.tools.host_time import main

if __name__ == "__main__":
    sys.exit(main())
