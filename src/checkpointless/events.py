"""Structured events and human logs, kept apart.

Structured events (fault, recovery, commit, ...) are JSON lines in ``<run_dir>/events.jsonl``
written by the launcher, and ``<run_dir>/rank-<r>.jsonl`` written by each worker: machines read
those. Human logs go to stderr, every line prefixed with who wrote it and the step it was at,
so interleaved output from many ranks can still be read.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

__all__ = ["EventLog", "RankContext", "get_logger", "open_private_append", "set_log_step", "setup_logging"]


def open_private_append(path: str | os.PathLike[str]) -> int:
    """Open ``path`` for appending, created 0600, refusing to follow a symlink.

    A run directory may be shared or predictable: a planted symlink would otherwise redirect our
    writes into another file, and a pre-created world-writable file would let others forge lines.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise OSError(e.errno, f"{path} is a symlink; refusing to write through it (remove it)") from e
        raise
    return fd


class RankContext:
    """Who is logging and at which step; read by the log formatter on every record."""

    def __init__(self) -> None:
        self.who = "launcher"
        self.step: int | None = None

    def prefix(self) -> str:
        if self.step is None:
            return f"[{self.who}]"
        return f"[{self.who} step {self.step}]"


_CONTEXT = RankContext()


class _PrefixFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        ms = int(record.msecs)
        return f"{stamp}.{ms:03d} {_CONTEXT.prefix()} {record.getMessage()}"


def setup_logging(who: str, level: int = logging.INFO, stream: TextIO | None = None) -> RankContext:
    """Route the ``checkpointless`` logger to ``stream`` with the rank/step prefix."""
    _CONTEXT.who = who
    logger = logging.getLogger("checkpointless")
    logger.setLevel(level)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_PrefixFormatter())
    logger.addHandler(handler)
    logger.propagate = False
    return _CONTEXT


def set_log_step(step: int | None) -> None:
    """The step that prefixes this process's log lines from now on."""
    _CONTEXT.step = step


def get_logger(name: str = "checkpointless") -> logging.Logger:
    return logging.getLogger(name)


class EventLog:
    """Append-only JSON-lines file. Each write is one ``write`` call of one line, flushed, so a
    reader never sees half an event even if the writer is killed right after."""

    def __init__(self, path: str | os.PathLike[str], **fixed: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fixed = fixed
        self._lock = threading.Lock()
        self._file = open(open_private_append(self.path), "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the log
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(record)`` after each event is written (metrics, progress). It runs on the
        emitting thread, so it must be quick; an exception in it is logged, never raised into the
        code that emitted the event."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"time": round(time.time(), 6), "event": event, **self._fixed, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # observing the job must never break it
                get_logger().exception("event listener failed on %s", event)
        return record

    def close(self) -> None:
        with self._lock:
            self._file.close()

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        p = Path(path)
        if not p.exists():
            return out
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
        return out
