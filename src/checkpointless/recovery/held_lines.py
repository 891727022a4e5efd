"""A section's held log lines, kept outside the process until shown, so that a replacement shows
the lines of a rank lost after the section closed and before it showed them.

An integration holds what a section logs (Trainer's ``on_log`` calls, Accelerate's ``print`` and
``log``) until the section has closed on every rank, and shows it then (``Section.closed``,
recovery/driver.py): a section redone after a fault shows its lines once. A rank lost after its
peers passed the closing barrier is not redone there, and its own held lines (rank 0's printed
evaluation line, its tracker's record) went with its process. So each rank also writes what it
holds (``Section.held.encode()``) beside its generator records, in the job's private shared
memory (``<job shm>/rng/rank<k>.held``), as the section's work is done and before the closing
barrier, and removes it once ``closed`` has shown it. A replacement that joins at that boundary
with the section completed and finds the file shows those lines, once (``Section.held.restore``
then ``closed``): the lines the run without the fault showed, each once.

The file is on the rank's host; the lines also ride in the rank's generator record to its
keeper one host over (up to a cap), whence a replacement after a host loss takes them into its
own host's file (recovery/section_closing.py). The limits: a rank lost while it was showing (a tracker that hangs) leaves the file, so its replacement shows
the lines from the first again; and one lost between showing the last line and removing the file
(microseconds) has its lines shown twice.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import xxhash

__all__ = ["HeldLinesFile"]

_MAGIC = b"CLHELD01"
_LEAD = struct.Struct("<8sII")  # magic, the header's length, the lines' length
_DIGEST = 16  # XXH3-128 of everything before it: a write cut short by a SIGKILL is refused


class HeldLinesFile:
    """Rank ``rank``'s held lines of one section at one boundary, in ``directory`` (None: not
    under the launcher, nothing kept)."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.directory = directory
        self.rank = rank

    def _path(self) -> Path | None:
        return None if self.directory is None else self.directory / f"rank{self.rank}.held"

    def keep(self, step: int, section: str, lines: bytes | None) -> None:
        """Keep ``lines`` (the section's ``held.encode()``) as held at step ``step``'s boundary;
        None (nothing held) removes an older attempt's."""
        path = self._path()
        if path is None:
            return
        if lines is None:
            self.drop()
            return
        head = json.dumps({"step": step, "section": section}).encode()
        body = _LEAD.pack(_MAGIC, len(head), len(lines)) + head + lines
        tmp = path.with_suffix(".held.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body + xxhash.xxh3_128_digest(body))
        finally:
            os.close(fd)
        os.replace(tmp, path)  # whole or not at all: never a torn file under the name

    def load(self, step: int, section: str) -> bytes | None:
        """The lines kept for ``section`` at step ``step``'s boundary (by this process or its
        predecessor on this host), else None."""
        path = self._path()
        if path is None:
            return None
        try:
            data = path.read_bytes()
            magic, n, m = _LEAD.unpack_from(data)
            body = data[: _LEAD.size + n + m]
            if magic != _MAGIC or len(data) != len(body) + _DIGEST:
                return None
            if xxhash.xxh3_128_digest(body) != data[len(body) :]:
                return None
            head = json.loads(body[_LEAD.size : _LEAD.size + n])
        except (OSError, struct.error, ValueError):
            return None
        if head.get("step") != step or head.get("section") != section:
            return None
        return bytes(body[_LEAD.size + n :])

    def drop(self) -> None:
        """The lines were shown (or nothing is held): remove the file."""
        path = self._path()
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
