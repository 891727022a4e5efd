"""Reading a run directory: the launcher's events and every rank's commits, as plain records.

The files are append-only JSON lines written one whole line per call, so a reader can read them
while the job runs. A line can still be cut short when the disk fills or the machine dies mid
write; only the last line of a file can be like that, and it is skipped rather than failing a
status query on a job that is otherwise readable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError

__all__ = ["RunFiles", "load_run", "read_jsonl"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON object in ``path``; a torn last line is left out."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.splitlines()
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # being written, or cut short by a crash: the rest of the file is still good
            raise ConfigError(
                f"{path}:{i + 1} is not a JSON line; is this a checkpointless run directory?"
            ) from None
        if isinstance(rec, dict):
            out.append(rec)
    return out


@dataclass
class RunFiles:
    """What a run directory holds: launcher events, and commit records from ``rank-<r>.jsonl``."""

    run_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)


def load_run(run_dir: str | os.PathLike[str]) -> RunFiles:
    """Read ``run_dir`` (never its ``secret``); a clear error when it is not a run directory."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ConfigError(f"run directory {str(d)!r} does not exist; pass the --run-dir of a job")
    if not (d / "events.jsonl").is_file():
        raise ConfigError(
            f"{str(d)!r} has no events.jsonl; pass the directory `checkpointless run` wrote "
            "(its first log line names it: 'run dir ...')"
        )
    files = RunFiles(d, events=read_jsonl(d / "events.jsonl"))
    for f in sorted(d.glob("rank-*.jsonl")):
        files.commits.extend(e for e in read_jsonl(f) if e.get("event") == "commit")
    files.commits.sort(key=lambda e: float(e.get("time", 0.0)))
    return files
