"""Reading a run directory's JSON-lines files: safely opened, streamed, every record checked.

The files are append-only JSON lines written one whole line per call, so a reader can read them
while the job runs. A line can still be cut short when the disk fills or the machine dies mid
write; only the last line of a file can be like that, and it is skipped rather than failing a
status query on a job that is otherwise readable.

A run directory may also be hostile (shared, predictable, or simply damaged), so this is where its
bytes become records:

- a file is opened without following a symlink, and must be a regular file (a FIFO would block
  the reader for ever);
- it is streamed a line at a time, each line at most :data:`MAX_LINE` bytes, so memory does not
  grow with the file;
- each record's fields are checked (``observe/records.py``). Every problem is one
  :class:`ConfigError` naming ``FILE:LINE``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.observe.records import BadRecord, TornLine, check_record, parse_line

__all__ = ["MAX_LINE", "file_id", "iter_jsonl", "open_regular", "read_jsonl"]

MAX_LINE = 64 * 1024  # bytes: the longest record a writer produces is a few kB


def open_regular(path: Path) -> int | None:
    """A read descriptor for ``path``, a regular file reached without a symlink; None if absent.

    Raises:
        ConfigError: ``path`` is a symlink, a FIFO, a device or a folder, or cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise ConfigError(
                f"{path} is a symlink; refusing to follow it (a run directory holds files)"
            ) from None
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file; a run directory's records are plain files")
    return fd


def iter_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool] | None = None) -> Iterator[dict[str, Any]]:
    """Each checked JSON object of ``path`` in order, streamed; a torn last line is left out.

    Nothing is yielded for a missing file. ``keep`` filters records before they are yielded.

    Raises:
        ConfigError: ``FILE:LINE`` and what is wrong with that line (or with the file).
    """
    fd = open_regular(path)
    if fd is None:
        return
    with os.fdopen(fd, "rb") as f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), start=1):
            if len(line) > MAX_LINE:
                raise ConfigError(f"{path}:{lineno}: line longer than {MAX_LINE // 1024} KiB; not a record")
            if not line.strip():
                continue
            try:
                rec = parse_line(line)
            except TornLine:
                if not line.endswith(b"\n") and line.lstrip().startswith(b"{"):
                    return  # the last line, being written or cut short by a crash: the rest is good
                raise ConfigError(
                    f"{path}:{lineno}: is not a JSON line; is this a checkpointless run directory?"
                ) from None
            except BadRecord as e:
                raise ConfigError(f"{path}:{lineno}: {e}") from None
            try:
                if not isinstance(rec, dict):
                    raise BadRecord("is not a JSON object")
                check_record(rec)
            except BadRecord as e:
                raise ConfigError(f"{path}:{lineno}: {e}") from None
            if keep is None or keep(rec):
                yield rec


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete, checked JSON object in ``path``; a torn last line is left out."""
    return list(iter_jsonl(path))


def file_id(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of ``path`` itself (a symlink not followed); None if it is absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)
