"""``python -m gtp_runtime.data prepare ...``: see :mod:`gtp_runtime.data.prepare`."""

from __future__ import annotations

import sys

from gtp_runtime.data.prepare import main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "prepare":
        print("usage: python -m gtp_runtime.data prepare --help", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
