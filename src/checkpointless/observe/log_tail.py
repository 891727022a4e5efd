"""Following a run directory's JSON-lines file that its writer rotates (a rank's commit log)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from checkpointless.observe.jsonl import MAX_LINE, file_id, open_regular

__all__ = ["LogTail"]


class LogTail:
    """Follows an append-only JSON-lines file that its writer rotates by renaming it to
    ``<name>.1`` (``recovery/commit_log.py``): each :meth:`poll` gives the complete lines written
    since the last one, across a rotation, each line once.

    The file being read is held open: the rename leaves the open descriptor on the same file, so
    its rest is read to the end before the new file at the path is started at 0. Holding it open
    also pins its inode: once the old ``.1`` is replaced and freed, a new log could reuse the
    inode, and a follower that knew its file only by number would then read the new file from
    the old offset, losing lines. A poll must come at least once per rotation (a rank's log
    rotates every ~360 commits), or the file in between is missed; lines over ``max_line`` are
    skipped, and a file is opened through :func:`open_regular` (no symlink, no FIFO).
    """

    def __init__(self, path: Path, max_line: int = MAX_LINE, chunk: int = 1 << 20) -> None:
        self.path = path
        self.max_line = max_line
        self.chunk = chunk  # bytes read per poll from the current file: a poll stays short
        self._file: BinaryIO | None = None
        self._partial = b""
        self._skipping = False  # inside a line over max_line

    def poll(self, _reopen: bool = True) -> list[bytes]:
        """The complete lines appended since the last call (without their newline).

        Raises:
            ConfigError: the path is a symlink or not a regular file.
        """
        if self._file is None:
            fd = open_regular(self.path)
            if fd is None:
                return []
            self._file = os.fdopen(fd, "rb")
        data = self._file.read(self.chunk)
        out = self._lines(data)
        if len(data) < self.chunk and file_id(self.path) != self._id():
            # rotated (or removed): what was appended before the rename is read above or here,
            # then the next poll opens the new file at the path from its start
            out += self._lines(self._file.read())
            self.close()
            if _reopen:  # once: a writer rotating faster than we read cannot keep us here
                out += self.poll(_reopen=False)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._partial, self._skipping = None, b"", False

    def _id(self) -> tuple[int, int] | None:
        if self._file is None:
            return None
        st = os.fstat(self._file.fileno())
        return (st.st_dev, st.st_ino)

    def _lines(self, data: bytes) -> list[bytes]:
        *lines, rest = (self._partial + data).split(b"\n")
        out = []
        for line in lines:
            if self._skipping:
                self._skipping = False  # the end of a line that was too long
            elif line.strip() and len(line) <= self.max_line:
                out.append(line)
        if len(rest) > self.max_line:
            rest, self._skipping = b"", True
        self._partial = rest
        return out
