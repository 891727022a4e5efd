"""A worker's stderr, passed through to the launcher's terminal and remembered.

When a process fails the launcher must say *why* in one line, and the why is in what the process
printed last (its traceback). Each process's stderr is therefore a pipe that one thread copies,
line by line, to the launcher's own stderr (so the user sees everything as before) while keeping
the last lines in memory for the error message.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import IO

__all__ = ["OutputTail"]


class OutputTail:
    """Copies a pipe to our stderr and keeps its last ``lines`` lines (bounded memory)."""

    def __init__(self, pipe: IO[bytes], lines: int = 40, max_line: int = 4096) -> None:
        self._tail: deque[str] = deque(maxlen=lines)
        self._lock = threading.Lock()
        self._max_line = max_line
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
                with self._lock:
                    self._tail.append(raw.decode("utf-8", "replace").rstrip("\n"))
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()

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
