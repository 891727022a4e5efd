"""A rank's commit log (``rank-<r>.jsonl``), bounded: it is rotated, and what rotates away is summed up.

A commit line is about 135 bytes, one per step per rank: 8,000 ranks for a million steps would
be a terabyte. So the log is two files at most, each about :data:`ROTATE_BYTES`:

- when ``rank-<r>.jsonl`` passes the cap it is renamed, whole, to ``rank-<r>.jsonl.1`` (replacing
  the one before), and a new ``rank-<r>.jsonl`` begins. A follower holding the old file open
  reads it to its end, then finds a new file (another inode) at the path and starts it at 0;
- the new file's first line is a ``commit_log`` record that sums up every commit before it: how
  many, how many distinct steps (steps are committed in order, so that is a count and the last
  step), and the first and last two commits of each recent generation. Those are the commits the
  goodput ledger places faults, start-up and recoveries against, so it stays exact; only its
  median step time is then taken over the commits still on disk.

The cap bounds the run directory at about ``2 * ROTATE_BYTES`` per rank whatever the job's
length (docs/operations.md, "Run directory size").
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from checkpointless.events import EventLog, open_private_append

__all__ = ["KEPT_GENERATIONS", "ROTATE_BYTES", "CommitLog"]

ROTATE_BYTES = 48 * 1024  # per file; two files per rank: 8,000 ranks stay under 1 GB
KEPT_GENERATIONS = 64  # generations whose boundary commits the summary carries (2.3 kB per 10)


class CommitLog(EventLog):
    """The ``EventLog`` of one rank, rotated at ``rotate_bytes`` with a summary line per file."""

    def __init__(self, path: str | os.PathLike[str], rotate_bytes: int = ROTATE_BYTES, **fixed: Any) -> None:
        super().__init__(path, **fixed)
        self.rotate_bytes = rotate_bytes
        self._rank = fixed.get("rank")
        self.commits = 0  # every commit written, this process's and (read back) those before it
        self.steps = 0  # distinct steps among them
        self.last_step = -1
        self._gens: OrderedDict[int | None, list[list[Any]]] = OrderedDict()  # gen -> [first, last2, last]
        self._restore()

    def _summary(self) -> dict[str, Any]:
        kept = [k for ks in self._gens.values() for k in ks]
        return {"commits": self.commits, "steps": self.steps, "last_step": self.last_step, "kept": kept}

    def _restore(self) -> None:
        """A replacement taking this rank over appends to its log: count what is there already."""
        try:
            with open(self.path, "rb") as f:
                lines = f.read(4 * self.rotate_bytes).splitlines()
        except OSError:
            return
        for line in lines:
            try:
                rec = json.loads(line)
                if rec.get("event") == "commit_log" and not self.commits:
                    self.commits, self.steps = int(rec["commits"]), int(rec["steps"])
                    self.last_step = int(rec["last_step"])
                    for k in rec["kept"]:
                        self._note(list(k))
                elif rec.get("event") == "commit":
                    self._count(rec)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn or foreign line: it only makes the summary a little short

    def _note(self, k: list[Any]) -> None:
        marks = self._gens.get(k[2])
        if marks is None:
            self._gens[k[2]] = [k]
            while len(self._gens) > KEPT_GENERATIONS:
                self._gens.popitem(last=False)
        elif len(marks) < 3:
            marks.append(k)
        else:
            marks[1], marks[2] = marks[2], k  # the first commit of the generation and its last two

    def _count(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        self.commits += 1
        if step > self.last_step:
            self.steps += 1
            self.last_step = step
        self._note([rec["time"], step, rec.get("generation"), bool(rec.get("rolled_forward", False))])

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = super().emit(event, **fields)
        if event == "commit":
            self._count(record)
            if os.fstat(self._file.fileno()).st_size >= self.rotate_bytes:
                self._rotate()
        return record

    def _rotate(self) -> None:
        """Rename the full file whole to ``.1`` and start the next with the summary of all before."""
        head = {"time": self._last_time(), "event": "commit_log", "rank": self._rank, **self._summary()}
        line = json.dumps(head, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                return
            self._file.close()
            os.replace(self.path, Path(f"{self.path}.1"))  # a rename never follows a symlink
            self._file = self._reopen()
            self._file.write(line)

    def _last_time(self) -> float:
        return float(next(reversed(self._gens.values()))[-1][0]) if self._gens else 0.0

    def _reopen(self) -> Any:
        return open(open_private_append(self.path), "a", buffering=1, encoding="utf-8")
