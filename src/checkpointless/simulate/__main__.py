"""``python -m checkpointless.simulate``: the goodput simulation's command line."""

from __future__ import annotations

import sys

from checkpointless.simulate.command import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
