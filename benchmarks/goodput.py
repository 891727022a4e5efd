"""Goodput at scale: run the simulation with its defaults and keep its result in the repository.

Writes benchmarks/results/goodput.json (the simulator's tables and plot go to a temporary folder
and its tables to stdout). Extra arguments are passed on, e.g. ``python benchmarks/goodput.py
--calibration cal.json``, or the no-spare policy of the "chosen policy" column:
``--no-spare-policy shrink|wait|fail --min-replicas N --spare-wait S --health-check on|off``
(default: wait, 1, 60, on), and ``--rendezvous rootless|rootless-full|tcp`` (default rootless, the launcher's).
The model and every assumption are described in docs/goodput.md.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from checkpointless.simulate import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    extra = sys.argv[1:]
    label = " ".join(["python benchmarks/goodput.py", *extra])
    with tempfile.TemporaryDirectory(prefix="cl-goodput-") as out:
        rc = main(["--out", out, "--label", label, *extra])
        if (Path(out) / "goodput.md").exists():
            print((Path(out) / "goodput.md").read_text())
        if (Path(out) / "goodput.json").exists():
            shutil.copy(Path(out) / "goodput.json", RESULTS / "goodput.json")
            print(f"wrote {RESULTS / 'goodput.json'}")
    sys.exit(rc)
