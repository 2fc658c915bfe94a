"""Text files to a Megatron indexed dataset: ``python scripts/prepare_data.py --help``.

The same as ``python -m gtp_runtime.data prepare``.
"""

import sys

from gtp_runtime.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
