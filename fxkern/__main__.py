"""``python -m fxkern``: see :mod:`fxkern.cli`."""

import sys

from fxkern.cli import main

if __name__ == "__main__":
    sys.exit(main())
