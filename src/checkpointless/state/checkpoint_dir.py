"""Where durable checkpoints live and how often they are saved, without importing torch.

The launcher validates ``--checkpoint-every`` and removes what an interrupted save left behind,
and it must not pay torch's import for that; the saving and loading (``durable.py``) need torch.
A checkpoint directory holds ``step-<N>`` directories; one is complete only once DCP's
``.metadata`` file is in it, and ``.tmp``/``.old`` directories never count.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from checkpointless.errors import ConfigError

__all__ = [
    "KEEP",
    "CheckpointEvery",
    "checkpoint_path",
    "list_checkpoints",
    "newest_checkpoint",
    "parse_every",
    "private_dir",
    "prune",
    "remove_partial",
]

KEEP = 2  # complete checkpoints kept: the newest, and one more in case the newest is unreadable
_NAME = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-\d+\.(tmp|old)(-\d+)?$")
_EVERY = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class CheckpointEvery:
    """How often rank 0 saves: every ``steps`` committed steps, or every ``seconds`` (0: off)."""

    steps: int = 0
    seconds: float = 0.0

    @property
    def off(self) -> bool:
        return self.steps == 0 and self.seconds == 0

    def to_text(self) -> str:
        if self.seconds:
            return f"{self.seconds:g}s"
        return str(self.steps)


def parse_every(text: str | int) -> CheckpointEvery:
    """``--checkpoint-every``: ``0`` (off), a number of steps (``200``), or a time with a unit
    (``90s``, ``10m``, ``1h``). A bad value is refused naming it and the accepted forms."""
    m = _EVERY.match(str(text))
    hint = "give 0 (off), a number of steps such as 500, or a time such as 90s, 10m or 1h"
    if m is None:
        raise ConfigError(f"--checkpoint-every {text!r} is not a step count or a time; {hint}")
    value, unit = m.groups()
    if not unit:
        if "." in value:
            raise ConfigError(f"--checkpoint-every {text!r}: a step count is a whole number; {hint}")
        return CheckpointEvery(steps=int(value))
    seconds = float(value) * _UNIT_S[unit]
    if seconds and seconds < 1:
        raise ConfigError(f"--checkpoint-every {text!r} is under one second; {hint}")
    return CheckpointEvery(seconds=seconds)


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step}"


def list_checkpoints(directory: Path) -> list[int]:
    """Steps of the complete checkpoints in ``directory``, oldest first: a ``step-<N>`` directory
    holding DCP's metadata file. ``.tmp`` and ``.old`` directories never count."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = [int(m.group(1)) for m in map(_NAME.match, names) if m]
    return sorted(s for s in steps if (checkpoint_path(directory, s) / ".metadata").is_file())


def newest_checkpoint(directory: Path | None) -> int | None:
    if directory is None:
        return None
    steps = list_checkpoints(directory)
    return steps[-1] if steps else None


def remove_partial(directory: Path) -> int:
    """Delete what an interrupted save or deletion left (``step-<N>.tmp``, ``step-<N>.old``);
    return how many. Complete checkpoints are never touched."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    gone = [n for n in names if _PARTIAL.match(n)]
    for n in gone:
        shutil.rmtree(directory / n, ignore_errors=True)
    return len(gone)


def private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.is_dir():
        raise ConfigError(f"checkpoint directory {path} is not a directory; give another --checkpoint-dir")


def prune(directory: Path) -> None:
    for s in list_checkpoints(directory)[:-KEEP]:
        old = directory / f"step-{s}.old-{os.getpid()}"
        # renamed first: a kill half-way through rmtree must not leave a "step-<N>" that is missing files
        os.rename(checkpoint_path(directory, s), old)
        shutil.rmtree(old, ignore_errors=True)
