"""``python -m gtp_runtime.data prepare ...``: see :mod:`gtp_runtime.data.prepare`."""

from __future__ import annotations

import sys

from gtp_runtime.data.prepare import EXAMPLES, main

USAGE = f"""usage: python -m gtp_runtime.data [-h] {{prepare}} ...

Data tools of gtp_runtime.

commands:
  prepare    text files (or JSON lines) to a Megatron indexed dataset, PREFIX.bin/.idx
             (python -m gtp_runtime.data prepare --help for its flags)

{EXAMPLES}"""

if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] != "prepare":
        print(USAGE, file=sys.stderr, end="")
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
