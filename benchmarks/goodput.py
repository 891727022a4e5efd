"""Goodput at scale: run the simulation with its defaults and keep the results in the repository.

Writes benchmarks/results/goodput.md (tables, command, machine), goodput.json and goodput.png.
Extra arguments are passed on, e.g. ``python benchmarks/goodput.py --calibration cal.json``.
The model and every assumption are described in docs/goodput.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from checkpointless.simulate import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    extra = sys.argv[1:]
    label = " ".join(["python benchmarks/goodput.py", *extra])
    sys.exit(main(["--out", str(RESULTS), "--label", label, *extra]))
