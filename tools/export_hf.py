"""Same as the ``pretrain-export-hf`` command; the code is src/pretrain/tools/export_hf.py."""
import sys

from pretrain.tools.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
