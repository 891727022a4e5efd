"""Reading a run directory: the launcher's events and every rank's commits, as validated records.

The files are append-only JSON lines written one whole line per call, so a reader can read them
while the job runs. A line can still be cut short when the disk fills or the machine dies mid
write; only the last line of a file can be like that, and it is skipped rather than failing a
status query on a job that is otherwise readable.

A run directory may also be hostile (shared, predictable, or simply damaged), so this is the one
place where its bytes become records:

- a file is opened without following a symlink, and must be a regular file (a FIFO would block
  the reader for ever);
- it is streamed a line at a time, each line at most :data:`MAX_LINE` bytes, so memory does not
  grow with the file: only the records that ``status`` and ``report`` use are kept, and of a
  commit only the fields they read;
- each record's fields are checked for type and range here, so the code behind gets numbers
  where it expects numbers. Every problem is one :class:`ConfigError` naming ``FILE:LINE``.

A rank's commit log is rotated by its writer (``recovery/commit_log.py``): ``rank-N.jsonl.1`` is
the previous file, renamed whole, and each file opens with a ``commit_log`` line that sums up the
commits before it (how many, how many distinct steps, and the first and last commits of each
generation: the ones the goodput ledger places faults against). Readers take both files and the
older file's summary.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from checkpointless.errors import ConfigError

__all__ = ["MAX_LINE", "LogTail", "RunFiles", "iter_jsonl", "load_run", "open_regular", "read_jsonl"]

MAX_LINE = 64 * 1024  # bytes: the longest record a writer produces is a few kB
_MAX_RANK = 1 << 20  # more ranks than any job has; a larger nproc is a damaged record
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
    )
)
# of a commit, only what the readers use: a commit line also carries buddy and snapshot figures
_COMMIT_FIELDS = ("time", "event", "rank", "worker", "step", "generation", "rolled_forward")


class _Bad(Exception):
    """A field of one record is wrong; the reader adds FILE:LINE."""


class _Torn(Exception):
    """A line is not JSON: the torn last line of a file being written, or garbage."""


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _Bad(f"number {text[:40]} is out of range")
    return x


def _no_constant(name: str) -> float:
    raise _Bad(f"{name} is not a number a writer produces")


def _parse(line: bytes) -> Any:
    try:
        return json.loads(line, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise _Bad("is nested too deeply to be a record") from None
    except UnicodeDecodeError:
        raise _Bad("is not UTF-8 text") from None
    except json.JSONDecodeError:
        raise _Torn from None
    except ValueError as e:  # an integer of thousands of digits
        raise _Bad(f"is not a record ({str(e)[:80]})") from None


def _int(rec: dict[str, Any], key: str, lo: int = 0, hi: int = 1 << 62, need: bool = True) -> None:
    v = rec.get(key)
    if v is None and not need:
        return
    if type(v) is not int or not lo <= v <= hi:  # bool is no count
        raise _Bad(f"field {key!r} must be an integer in [{lo}, {hi}] (got {_show(v)})")


def _num(rec: dict[str, Any], key: str, need: bool = False, lo: float = 0.0) -> None:
    v = rec.get(key)
    if v is None and not need:
        return
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v:  # finite: the parser saw to it
        raise _Bad(f"field {key!r} must be a number >= {lo:g} (got {_show(v)})")


def _str(rec: dict[str, Any], key: str, need: bool = False) -> None:
    v = rec.get(key)
    if (v is not None or need) and not isinstance(v, str):
        raise _Bad(f"field {key!r} must be a string (got {_show(v)})")


def _show(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, str | int | float | bool) or v is None else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _check_fault(f: Any) -> None:
    if not isinstance(f, dict):
        raise _Bad("a fault in 'faults' must be an object")
    _num(f, "time", need=True)
    _str(f, "kind")
    _int(f, "rank", need=False, hi=_MAX_RANK)
    _int(f, "generation", lo=-1, need=False)
    _int(f, "step", lo=-1, need=False)


def _check(rec: dict[str, Any]) -> None:
    """The fields of ``rec`` that readers use have the types they expect (``_Bad`` if not)."""
    _num(rec, "time", need=True)
    _str(rec, "event", need=True)
    kind = rec["event"]
    if kind == "commit":
        _int(rec, "rank", hi=_MAX_RANK)
        _int(rec, "step", lo=-1)
        _int(rec, "generation", lo=-1, need=False)
        _int(rec, "worker", need=False)
        if not isinstance(rec.get("rolled_forward", False), bool):
            raise _Bad("field 'rolled_forward' must be true or false")
    elif kind == "commit_log":
        _int(rec, "rank", hi=_MAX_RANK)
        _int(rec, "commits")
        _int(rec, "steps")
        _int(rec, "last_step", lo=-1)
        kept = rec.get("kept")
        if not isinstance(kept, list) or not all(_kept_ok(k) for k in kept):
            raise _Bad("field 'kept' must be a list of [time, step, generation, rolled_forward]")
    elif kind == "job_start":
        _int(rec, "nproc", hi=_MAX_RANK)
        _int(rec, "pid", need=False)
        _str(rec, "host")
        _str(rec, "job")
    elif kind == "job_end":
        _str(rec, "status")
    elif kind == "spawn":
        _int(rec, "worker")
        _int(rec, "pid")
        _str(rec, "role", need=True)
    elif kind in ("spare_ready", "spare_lost"):
        _int(rec, "worker")
    elif kind == "spare_assigned":
        _int(rec, "rank", hi=_MAX_RANK)
        _int(rec, "worker")
        _int(rec, "generation", lo=-1, need=False)
    elif kind == "started":
        _int(rec, "generation", lo=-1)
    elif kind == "recovery":
        _int(rec, "generation", lo=-1)
        _num(rec, "downtime_s", need=True)
        for k in ("detect_s", "collect_s", "rebuild_s", "transfer_s", "first_batch_s", "first_step_s"):
            _num(rec, k)
        _num(rec, "state_bytes")
        faults = rec.get("faults")
        if faults is not None:
            if not isinstance(faults, list):
                raise _Bad("field 'faults' must be a list")
            for f in faults:
                _check_fault(f)
    elif kind == "fault":
        _check_fault(rec)


def _kept_ok(k: Any) -> bool:
    return (
        isinstance(k, list)
        and len(k) == 4
        and type(k[0]) in (int, float)
        and type(k[1]) is int
        and (k[2] is None or type(k[2]) is int)
        and isinstance(k[3], bool)
    )


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
                rec = _parse(line)
            except _Torn:
                if not line.endswith(b"\n") and line.lstrip().startswith(b"{"):
                    return  # the last line, being written or cut short by a crash: the rest is good
                raise ConfigError(
                    f"{path}:{lineno}: is not a JSON line; is this a checkpointless run directory?"
                ) from None
            except _Bad as e:
                raise ConfigError(f"{path}:{lineno}: {e}") from None
            try:
                if not isinstance(rec, dict):
                    raise _Bad("is not a JSON object")
                _check(rec)
            except _Bad as e:
                raise ConfigError(f"{path}:{lineno}: {e}") from None
            if keep is None or keep(rec):
                yield rec


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete, checked JSON object in ``path``; a torn last line is left out."""
    return list(iter_jsonl(path))


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
    cur_ino = _ino(path)
    files = [path] if older.exists() and _ino(older) == cur_ino else [older, path]  # mid rotation
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


def _ino(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


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
        if len(data) < self.chunk and _ino(self.path) != self._id():
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
