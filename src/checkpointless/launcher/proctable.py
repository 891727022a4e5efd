"""What the kernel's process table says about a process: its scheduler state and CPU time.

The launcher reads ``/proc/<pid>/stat`` for every process it started. That sees a stopped process
(SIGSTOP, state ``T``) the moment it stops, instead of after a heartbeat timeout, and it tells a
process that is still importing (its CPU time grows) from one that is wedged before it ever
connected (no CPU time, no connection). Parsing is a pure function so it is tested without
processes; reading is one small file per process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ProcSample", "parse_stat", "read_sample"]

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcSample:
    """One reading of a process's entry in the process table."""

    pid: int
    state: str  # R running, S sleeping, D disk wait, T stopped, t traced, Z zombie, X dead, ...
    cpu_s: float  # user + system CPU time consumed so far

    @property
    def stopped(self) -> bool:
        # only a job-control stop: "t" is a debugger or profiler (py-spy) attached for a moment
        return self.state == "T"

    @property
    def gone(self) -> bool:
        return self.state in ("Z", "X")


def parse_stat(pid: int, text: str) -> ProcSample | None:
    """Parse ``/proc/<pid>/stat``. The command name (field 2) may contain spaces and parentheses,
    so the fields after it are found from the *last* closing parenthesis. None if malformed."""
    end = text.rfind(")")
    if end < 0:
        return None
    rest = text[end + 1 :].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15
    if len(rest) < 13 or len(rest[0]) != 1:
        return None
    try:
        ticks = int(rest[11]) + int(rest[12])
    except ValueError:
        return None
    return ProcSample(pid=pid, state=rest[0], cpu_s=ticks / _CLK_TCK)


def read_sample(pid: int) -> ProcSample | None:
    """The process's current entry; None when it has no entry (gone) or /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return parse_stat(pid, f.read())
    except OSError:
        return None
