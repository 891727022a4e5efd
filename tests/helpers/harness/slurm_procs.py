"""The processes of a test Slurm cluster, found by a tag in their environment, and the sweep of a
crashed run's leftovers. Used by slurm.py; apart so that file stays about the cluster itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

from ._common import HarnessError, owner_alive

__all__ = [
    "BASE_PREFIX",
    "DAEMON_COMMS",
    "DIR_RE",
    "TAG_ENV",
    "kill_tagged",
    "proc_comm",
    "sweep_stale",
    "tagged_pids",
]

TAG_ENV = "CHECKPOINTLESS_SLURM_TAG"
BASE_PREFIX = "cpls"
DIR_RE = re.compile(rf"^{BASE_PREFIX}-(\d+)-([0-9a-f]{{6}})$")
# the cluster's own long-lived processes (slurmscriptd is slurmctld's script helper)
DAEMON_COMMS = frozenset({"munged", "slurmctld", "slurmscriptd", "slurmd"})


def tagged_pids(tag: str) -> list[int]:
    """Every process whose environment carries ``CHECKPOINTLESS_SLURM_TAG=<tag>``."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue  # gone meanwhile, or a kernel thread
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def proc_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def kill_tagged(tag: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    killed: list[int] = []
    while True:
        pids = tagged_pids(tag)
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() >= deadline:
            raise HarnessError(f"Slurm processes {pids} (tag {tag}) survived SIGKILL for {timeout:.0f}s")
        time.sleep(0.05)


def sweep_stale(tmp: Path = Path("/tmp")) -> list[Path]:
    """Kill the processes and remove the directories of clusters whose creating process is gone."""
    removed = []
    for d in tmp.glob(f"{BASE_PREFIX}-*"):
        m = DIR_RE.match(d.name)
        if m and not owner_alive(int(m.group(1))):
            kill_tagged(d.name, timeout=10.0)
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
