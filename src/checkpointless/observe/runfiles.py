"""Reading a run directory: the launcher's events and every rank's commits, as validated records.

Of the launcher's events only the kinds that ``status``, ``report`` and the timeline read are
kept, and of a commit only the fields they read, so memory does not grow with the job's length.
Each file is read through ``observe/jsonl.py`` (no symlink, no FIFO, lines of bounded length,
every record checked: ``observe/records.py``); every problem is one :class:`ConfigError` naming
``FILE:LINE``.

A rank's commit log is rotated by its writer (``recovery/commit_log.py``): ``rank-N.jsonl.1`` is
the previous file, renamed whole, and each file opens with a ``commit_log`` line that sums up the
commits before it (how many, how many distinct steps, and the first and last commits of each
generation: the ones the goodput ledger places faults against). Readers take both files and the
older file's summary; a live follower of one log is :class:`~checkpointless.observe.log_tail.LogTail`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError

# the line reader and the log follower lived here; still importable from here
from checkpointless.observe.jsonl import MAX_LINE, file_id, iter_jsonl, open_regular, read_jsonl
from checkpointless.observe.log_tail import LogTail

__all__ = ["MAX_LINE", "LogTail", "RunFiles", "iter_jsonl", "load_run", "open_regular", "read_jsonl"]

_RANK_FILE = re.compile(r"rank-(\d{1,7})\.jsonl")

# the launcher's events that status, report and the timeline read; the rest are checked and dropped
_KEPT_EVENTS = frozenset(
    (
        "job_start",
        "job_end",
        "spawn",
        "spare_ready",
        "spare_assigned",
        "spare_lost",
        "started",
        "recovery",
        "fault",
        # host health (coordinator/health.py), for status's host lines
        "host_health",
        "host_quarantined",
        "host_readmitted",
        "host_lost",
    )
)
# of a commit, only what the readers use: a commit line also carries buddy and snapshot figures
_COMMIT_FIELDS = ("time", "event", "rank", "worker", "step", "generation", "rolled_forward")


@dataclass
class RunFiles:
    """What a run directory holds: launcher events, and commit records from ``rank-<r>.jsonl``.

    ``events`` are the kinds that status, report and the timeline read; ``commits`` carry only
    the fields they read. ``dropped`` is, per rank, how many commits and distinct steps its log
    rotated away (their first and last commits of each generation are in ``commits``).
    """

    run_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[int, dict[str, int]] = field(default_factory=dict)

    def steps_committed(self, counted: int) -> int:
        """The ledger's ``counted`` steps (distinct steps among rank 0's commits here) plus the
        distinct steps rank 0's log rotated away, which it committed in order before them."""
        d = self.dropped.get(0)
        if d is None:
            return counted
        kept = {c["step"] for c in self.commits if c["rank"] == 0 and not c.get("kept")}
        return (
            counted
            - len({c["step"] for c in self.commits if c["rank"] == 0})
            + d["steps"]
            + sum(1 for s in kept if s > d["last_step"])
        )


def _keep_event(rec: dict[str, Any]) -> bool:
    return rec["event"] in _KEPT_EVENTS


def _read_rank(path: Path, rank: int, run: RunFiles) -> None:
    """One rank's commits: the rotated-away summary, the previous file, then the current one."""
    older = path.with_name(path.name + ".1")
    seen: set[tuple[Any, ...]] = set()
    summary: dict[str, Any] | None = None
    cur_ino = file_id(path)
    files = [path] if older.exists() and file_id(older) == cur_ino else [older, path]  # mid rotation
    for f in files:
        for rec in iter_jsonl(f, keep=lambda r: r["event"] in ("commit", "commit_log")):
            if rec["rank"] != rank:
                raise ConfigError(f"{f} holds a record of rank {rec['rank']}; the file is rank {rank}'s")
            if rec["event"] == "commit_log":
                summary = summary or rec  # the oldest file's summary is what was dropped
                continue
            c = {k: rec[k] for k in _COMMIT_FIELDS if k in rec}
            seen.add((c["step"], c.get("generation"), c["time"]))
            run.commits.append(c)
    if summary is None:
        return
    run.dropped[rank] = {
        "commits": summary["commits"],
        "steps": summary["steps"],
        "last_step": summary["last_step"],
    }
    for t, step, gen, rolled in summary["kept"]:
        if (step, gen, t) not in seen:
            c = {"time": t, "event": "commit", "rank": rank, "step": step, "kept": True}
            if gen is not None:
                c["generation"] = gen
            if rolled:
                c["rolled_forward"] = True
            run.commits.append(c)


def load_run(run_dir: str | os.PathLike[str]) -> RunFiles:
    """Read ``run_dir`` (never its ``secret``); a clear error when it is not a run directory.

    Raises:
        ConfigError: no such directory, no ``events.jsonl``, or a file or line in it is damaged
            (the message names ``FILE:LINE``).
    """
    d = Path(run_dir)
    if not d.is_dir():
        raise ConfigError(f"run directory {str(d)!r} does not exist; pass the --run-dir of a job")
    events = d / "events.jsonl"
    if not os.path.lexists(events):
        raise ConfigError(
            f"{str(d)!r} has no events.jsonl; pass the directory `checkpointless run` wrote "
            "(its first log line names it: 'run dir ...')"
        )
    files = RunFiles(d, events=list(iter_jsonl(events, keep=_keep_event)))
    for f in sorted(d.glob("rank-*.jsonl")):
        m = _RANK_FILE.fullmatch(f.name)
        if m is not None:
            _read_rank(f, int(m.group(1)), files)
    files.commits.sort(key=lambda e: float(e["time"]))
    return files
