"""The checkpointless job of benchmarks/degraded.py: examples/train_gpt.py unchanged, with its spares
held back so that the job runs degraded.

Under ``checkpointless run --spares 0`` a lost rank's replacement is forked at once and is ready
within a fraction of a second; on a real cluster a lost host's capacity is gone until a host is
repaired or added. A spare (``CHECKPOINTLESS_ROLE=spare``) of this script therefore waits before
it becomes ready: for ever with ``--spare-at-step -1`` (no capacity ever comes back; the launcher
kills it with the job), or until rank 0 has committed step ``--spare-at-step`` (read from
``--gate-dir``'s ``rank-0.jsonl``), when the capacity returns and the job grows back. Every other
argument goes to examples/train_gpt.py, which then runs as if started directly.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def committed(run_dir: Path) -> int:
    """The newest step rank 0 has committed, from its log (-1 before the first)."""
    try:
        lines = (run_dir / "rank-0.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return -1
    last = -1
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if e.get("event") == "commit":
            last = max(last, int(e["step"]))
    return last


def hold_spare(spare_at_step: int, gate_dir: Path) -> None:
    while spare_at_step < 0 or committed(gate_dir) < spare_at_step:
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spare-at-step", type=int, default=-1, help="-1: a spare never becomes ready")
    ap.add_argument("--gate-dir", default="", help="the job's --run-dir (rank 0's commits)")
    ours, rest = ap.parse_known_args()
    if os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
        hold_spare(ours.spare_at_step, Path(ours.gate_dir))
    sys.argv = [str(EXAMPLE), *rest]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
