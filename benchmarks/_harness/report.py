"""What every benchmark writes: the machine it ran on, its command, and one result file."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .procs import REPO

__all__ = ["add_model_args", "add_run_args", "load_note", "machine_info", "save_result", "write_json"]


# -- provenance --------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    import torch  # only for the version string

    commit = None
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        commit = head.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_gib": mem_gb,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "git": commit,
    }


def load_note(start: Sequence[float], end: Sequence[float]) -> str:
    return (
        f"load average (1/5/15 min) {start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f} at the start, "
        f"{end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} at the end; the machine is shared with other work"
    )


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def save_result(out: str | Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write a benchmark's result file and say where."""
    write_json(Path(out), result)
    print(f"\nwrote {out}")
    return result


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The example GPT's size flags, with the defaults every benchmark here uses."""
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training process")


def add_run_args(ap: argparse.ArgumentParser, *, run_timeout: float, out: str | None) -> None:
    """Each job's time limit, where its run directories go, and the result file."""
    ap.add_argument("--run-timeout", type=float, default=run_timeout, help="limit per job run, seconds")
    ap.add_argument("--work-dir", help="keep the run directories here (default: temporary, removed)")
    ap.add_argument("--out", default=out, help="JSON output")
