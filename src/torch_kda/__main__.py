"""``python -m torch_kda demo | bench | check``: see :mod:`torch_kda.cli`."""

from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); returns the exit status."""
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
