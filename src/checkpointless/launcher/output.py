"""A worker's stderr, passed through to the launcher's terminal, remembered and kept.

When a process fails the launcher must say *why* in one line, and the why is in what the process
printed last (its traceback). Each process's stderr is therefore a pipe that one thread copies,
line by line, to the launcher's own stderr (so the user sees everything as before) while keeping
the last lines in memory for the error message, and to the process's own log file in the run
directory (``logs/worker-<id>.log``): after a fault, which process said what is one file to read,
not a guess from interleaved lines of many ranks.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO

from checkpointless.events import open_private_append

__all__ = ["OutputTail", "worker_log"]


def worker_log(run_dir: Path, worker_id: int) -> Path:
    """Where a worker's (or spare's) stderr is kept: one file per process, named by its worker
    id (``spawn`` events give each id's role and pid, ``spare_assigned`` the rank a spare took
    over)."""
    return run_dir / "logs" / f"worker-{worker_id}.log"


LOG_MAX = 64 << 20  # a worker's log file stops growing here (one line says so)


class OutputTail:
    """Copies a pipe to our stderr and keeps its last ``lines`` lines (bounded memory); with
    ``log``, also appends it to that file, up to ``log_max`` bytes."""

    def __init__(
        self,
        pipe: IO[bytes],
        lines: int = 40,
        max_line: int = 4096,
        log: Path | None = None,
        log_max: int = LOG_MAX,
    ) -> None:
        self._tail: deque[str] = deque(maxlen=lines)
        self._lock = threading.Lock()
        self._max_line = max_line
        self._log_fd = -1
        self._log_left = log_max
        if log is not None:
            try:
                log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._log_fd = open_private_append(log)
            except OSError as e:  # the run goes on without the file; the terminal still has it
                print(f"[launcher] cannot keep a log in {log}: {e}", file=sys.stderr, flush=True)
        self._thread = threading.Thread(target=self._pump, args=(pipe,), daemon=True, name="cl-output")
        self._thread.start()

    def _pump(self, pipe: IO[bytes]) -> None:
        out = sys.stderr.buffer
        try:
            # readline with a cap: a process writing one endless line must not grow our memory
            for raw in iter(lambda: pipe.readline(self._max_line), b""):
                try:
                    out.write(raw)
                    out.flush()
                except (OSError, ValueError):
                    pass  # our own stderr is gone; keep draining so the worker never blocks
                self._keep(raw)
                with self._lock:
                    self._tail.append(raw.decode("utf-8", "replace").rstrip("\n"))
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()
            if self._log_fd >= 0:
                os.close(self._log_fd)
                self._log_fd = -1

    def _keep(self, raw: bytes) -> None:
        if self._log_fd < 0:
            return
        try:
            if len(raw) > self._log_left:
                os.write(self._log_fd, b"[launcher] log truncated here: it reached its size limit\n")
                os.close(self._log_fd)
                self._log_fd = -1
                return
            os.write(self._log_fd, raw)
            self._log_left -= len(raw)
        except OSError:  # a full disk must not stop the pipe from draining
            os.close(self._log_fd)
            self._log_fd = -1

    def tail(self, lines: int = 12, wait: float = 0.5) -> str:
        """The last lines; waits briefly for the pipe to drain (a dead process's last words)."""
        self._thread.join(wait)
        with self._lock:
            return "\n".join(list(self._tail)[-lines:])

    def cause(self) -> str:
        """The most telling single line: the last exception line of a traceback, else the last line."""
        with self._lock:
            lines = [x for x in self._tail if x.strip()]
        for line in reversed(lines):
            text = line.split("] ", 1)[-1] if line[:1].isdigit() else line
            if ("Error" in text or "Exception" in text) and not text.startswith((" ", "Traceback")):
                return text.strip()
        return lines[-1].strip() if lines else ""
