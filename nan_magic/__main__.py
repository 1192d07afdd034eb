"""``python -m nan_magic``: see :mod:`nan_magic.cli`."""

from __future__ import annotations

import sys

from nan_magic.cli import main

if __name__ == "__main__":
    sys.exit(main())
