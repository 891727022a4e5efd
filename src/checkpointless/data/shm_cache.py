"""Batches kept in shared memory (/dev/shm) so that they outlive the process that prepared them.

Layout: ``<root>/<job dir>/rank<NNNNN>/step<NNNNNNNNNNNN>.batch``, one file per
(rank, step). A file is a 4096-byte header (magic, then JSON naming the dataset fingerprint, seed,
shuffle, seq_len, global batch, dp rank/size, step, shape, dtype and the batch digest) followed by
the int64 inputs and targets. Files are written under a hidden temporary name and renamed into
place, so a reader sees a whole batch or none. A reader maps a file copy-on-write and returns
arrays over the mapping: no copy, and writing to the tensor never changes the file.

A file whose header does not match what the reader asks for (another step, seed, sharding or
dataset), whose size is wrong, or whose bytes do not hash to its digest is never served: the
reader reports a miss and the loader rebuilds and overwrites it. The files of a rank are kept to
a window of ``behind`` steps before and ``capacity`` steps after the current step. They survive
their writer, which is the point: a replacement process (or a re-run of the step) reads them at
once. The launcher removes the whole directory with :func:`remove_job_cache` when the job ends, and
:func:`start_cache_janitor` removes it even if the launcher itself is SIGKILLed.

The job directory is ``checkpointless-<uid>-<key>`` when ``$CHECKPOINTLESS_SHM_KEY`` is set (the
launcher sets a random key and hands it to its processes through the environment only, never a
command line, so another user can neither predict the name nor plant a directory there first),
else ``checkpointless-<job_id>`` for standalone use.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import mmap
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from checkpointless.config import job_shm_name
from checkpointless.data.digest import array_digest
from checkpointless.errors import ConfigError, DataError

__all__ = [
    "BatchKey",
    "CacheStats",
    "ShmBatchCache",
    "default_cache_root",
    "job_cache_dir",
    "remove_job_cache",
    "start_cache_janitor",
]

_MAGIC = b"CKPLBAT1"
_VERSION = 1
_HEADER_BYTES = 4096  # page-aligned payload: the int64 arrays map straight onto whole pages
_PREFIX = struct.Struct("<8sI")
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_STEP_FILE = re.compile(r"^step(\d{12})\.batch$")
_STALE_TMP_S = 60.0  # a temporary file this old belongs to a writer that died mid-write


def default_cache_root() -> Path:
    """$CHECKPOINTLESS_SHM_DIR, else /dev/shm, else the temp dir (macOS has no /dev/shm)."""
    env = os.environ.get("CHECKPOINTLESS_SHM_DIR")
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def job_cache_dir(job_id: str, root: str | os.PathLike[str] | None = None) -> Path:
    """The directory that holds every cached batch of ``job_id`` on this node (private and
    unguessable under the launcher: see the module's notes on ``$CHECKPOINTLESS_SHM_KEY``)."""
    if not _JOB_ID.match(job_id):
        raise ConfigError(f"job_id {job_id!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")
    return Path(root if root is not None else default_cache_root()) / job_shm_name(job_id)


@dataclasses.dataclass(frozen=True)
class BatchKey:
    """Everything that determines a rank's batch; a cached file must match all of it to be served."""

    fingerprint: str
    seed: int
    shuffle: bool
    seq_len: int
    global_batch: int
    dp_rank: int
    dp_size: int
    step: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.global_batch // self.dp_size, self.seq_len)

    @property
    def payload_bytes(self) -> int:
        rows, cols = self.shape
        return 2 * rows * cols * 8


@dataclasses.dataclass
class CacheStats:
    """Counters of one cache object (this process only)."""

    hits: int = 0
    misses: int = 0
    stale: int = 0
    writes: int = 0
    evictions: int = 0


def _make_private_dir(path: Path) -> None:
    # /dev/shm is writable by every user: refuse a directory (or symlink) planted by someone else,
    # since its files would be served to training as if we had written them.
    path.mkdir(mode=0o700, parents=False, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise DataError(
            f"{path}: batch cache directory is not a private directory owned by this user; "
            "remove it or choose another job_id / CHECKPOINTLESS_SHM_DIR"
        )


class ShmBatchCache:
    """One rank's batch files in the node's shared-memory cache of a job."""

    def __init__(
        self,
        job_id: str,
        rank: int,
        capacity: int = 8,
        *,
        behind: int = 2,
        root: str | os.PathLike[str] | None = None,
        verify_checksum: bool = True,
    ) -> None:
        if rank < 0:
            raise ConfigError(f"rank must be non-negative, got {rank}")
        if capacity < 0 or behind < 0:
            raise ConfigError(f"capacity and behind must be non-negative, got {capacity} and {behind}")
        self.job_id = job_id
        self.rank = rank
        self.capacity = capacity
        self.behind = behind
        self.verify_checksum = verify_checksum
        self.job_dir = job_cache_dir(job_id, root)
        self.dir = self.job_dir / f"rank{rank:05d}"
        self.stats = CacheStats()
        # Guards the stats and makes "is this step inside the window? then publish it" atomic with
        # respect to trim(), so that a prefetch thread can never publish a step that trim() just
        # moved the window past. Readers need no lock: a rename is atomic.
        self._lock = threading.Lock()
        self._current: int | None = None
        try:
            self.job_dir.parent.mkdir(parents=True, exist_ok=True)
            _make_private_dir(self.job_dir)
            _make_private_dir(self.dir)
        except OSError as e:
            raise DataError(
                f"{self.dir}: cannot create the batch cache ({e}); check CHECKPOINTLESS_SHM_DIR"
            ) from e

    def path_for(self, step: int) -> Path:
        return self.dir / f"step{step:012d}.batch"

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + 1)

    def _read_header(self, mm: mmap.mmap | bytes) -> dict[str, Any] | None:
        if len(mm) < _HEADER_BYTES:
            return None
        magic, length = _PREFIX.unpack_from(mm)
        if magic != _MAGIC or length > _HEADER_BYTES - _PREFIX.size:
            return None
        try:
            fields = json.loads(bytes(mm[_PREFIX.size : _PREFIX.size + length]))
        except ValueError:
            return None
        return fields if isinstance(fields, dict) else None

    @staticmethod
    def _matches(fields: dict[str, Any], key: BatchKey, size: int) -> bool:
        # not dataclasses.asdict: it deep-copies every field, a tenth of a cache hit's time
        want = {f.name: getattr(key, f.name) for f in dataclasses.fields(key)}
        return (
            fields.get("version") == _VERSION
            and all(fields.get(k) == v for k, v in want.items())
            and fields.get("shape") == list(key.shape)
            and fields.get("dtype") == "<i8"
            and size == _HEADER_BYTES + key.payload_bytes
            and isinstance(fields.get("digest"), str)
        )

    def get(self, key: BatchKey) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], str] | None:
        """(inputs, targets, digest) mapped from the cache, or None on a miss or an unusable file."""
        try:
            with open(self.path_for(key.step), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < _HEADER_BYTES:
                    self._count("stale")
                    return None
                # ACCESS_COPY (MAP_PRIVATE): pages are shared with /dev/shm until someone writes to
                # the tensor, which then gets a private copy instead of corrupting the file.
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            self._count("misses")
            return None
        fields = self._read_header(mm)
        if fields is None or not self._matches(fields, key, size):
            self._count("stale")
            return None
        rows, cols = key.shape
        n = rows * cols
        x = np.frombuffer(mm, dtype="<i8", count=n, offset=_HEADER_BYTES).reshape(rows, cols)
        y = np.frombuffer(mm, dtype="<i8", count=n, offset=_HEADER_BYTES + 8 * n).reshape(rows, cols)
        digest = str(fields["digest"])
        if self.verify_checksum and array_digest(x, y) != digest:
            self._count("stale")
            return None
        self._count("hits")
        return x, y, digest

    def contains(self, key: BatchKey) -> bool:
        """Whether a file for ``key`` is present with a matching header (its bytes are not hashed)."""
        try:
            with open(self.path_for(key.step), "rb") as f:
                head = f.read(_HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return False
        fields = self._read_header(head)
        return fields is not None and self._matches(fields, key, size)

    def put(self, key: BatchKey, x: npt.NDArray[np.int64], y: npt.NDArray[np.int64], digest: str = "") -> str:
        """Publish a batch atomically (temporary file + rename); returns its digest."""
        if x.shape != key.shape or y.shape != key.shape or x.dtype != np.int64 or y.dtype != np.int64:
            raise DataError(
                f"batch of shapes {x.shape}/{y.shape} does not fit key shape {key.shape} of int64"
            )
        digest = digest or array_digest(x, y)
        fields = {**dataclasses.asdict(key), "version": _VERSION, "shape": list(key.shape), "dtype": "<i8"}
        fields["digest"] = digest
        fields["writer_pid"] = os.getpid()
        body = json.dumps(fields, sort_keys=True).encode()
        head = _PREFIX.pack(_MAGIC, len(body)) + body
        tmp = self.dir / f".tmp-step{key.step:012d}-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(head + b"\0" * (_HEADER_BYTES - len(head)))
                f.write(np.ascontiguousarray(x, dtype="<i8").data.cast("B"))
                f.write(np.ascontiguousarray(y, dtype="<i8").data.cast("B"))
            # No fsync: /dev/shm is memory, and a batch lost with the node is simply rebuilt.
            with self._lock:
                if not self._in_window(key.step):
                    tmp.unlink()
                    return digest
                os.replace(tmp, self.path_for(key.step))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            # The cache directory was removed under us (job ending) or shared memory is full:
            # the batch is still correct in memory, so training continues without caching it.
            if isinstance(e, FileNotFoundError) or e.errno == errno.ENOSPC:
                return digest
            raise DataError(f"{self.dir}: cannot write a cached batch ({e})") from e
        self._count("writes")
        return digest

    def steps(self) -> list[int]:
        """Steps that currently have a (published) file for this rank, in order."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP_FILE.match, names) if m)

    def _in_window(self, step: int) -> bool:
        cur = self._current
        return cur is None or cur - self.behind <= step <= cur + self.capacity

    def trim(self, current_step: int) -> int:
        """Make ``current_step`` the current step: delete this rank's files outside
        ``[current - behind, current + capacity]`` (and dead writers' temporary files), and refuse to
        publish outside that window until the next call. Returns the number of batches deleted."""
        removed = 0
        with self._lock:
            self._current = current_step
            try:
                entries = list(os.scandir(self.dir))
            except FileNotFoundError:
                return 0
            now = time.time()
            for e in entries:
                m = _STEP_FILE.match(e.name)
                try:
                    if m and not self._in_window(int(m.group(1))):
                        os.unlink(e.path)
                        removed += 1
                    elif e.name.startswith(".tmp-") and now - e.stat().st_mtime > _STALE_TMP_S:
                        os.unlink(e.path)
                except FileNotFoundError:
                    pass  # another process with the same rank removed it first
            self.stats.evictions += removed
        return removed

    def __repr__(self) -> str:
        return f"ShmBatchCache({str(self.dir)!r}, capacity={self.capacity}, behind={self.behind})"


def remove_job_cache(
    job_id: str, root: str | os.PathLike[str] | None = None, *, timeout: float = 5.0
) -> bool:
    """Remove the job's whole cache directory; True when something was removed.

    Retries until ``timeout`` because a worker that is still prefetching may create a file while the
    tree is being deleted; after the deadline a DataError names what is left.
    """
    path = job_cache_dir(job_id, root)
    deadline = time.monotonic() + timeout
    existed = path.exists()
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return existed
        if time.monotonic() >= deadline:
            raise DataError(f"{path}: could not remove the batch cache within {timeout} s; remove it by hand")
        time.sleep(0.01)


_JANITOR = (
    "import os, shutil, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "sys.stdin.buffer.read()\n"  # returns at EOF: the launcher closed the pipe or died
    "shutil.rmtree(os.environ['CHECKPOINTLESS_JANITOR_PATH'], ignore_errors=True)\n"
)


def start_cache_janitor(job_id: str, root: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
    """Start a tiny process that removes the job's cache when the calling process exits, however it exits.

    The janitor waits for end-of-file on a pipe whose only writer is the caller, so even a SIGKILL of
    the caller (which runs no cleanup code) triggers the removal. To end the job normally, close
    ``janitor.stdin`` and wait for it (or call :func:`remove_job_cache`, then close). It uses only
    the standard library, so it starts in tens of milliseconds and holds little memory. Children
    forked (not spawned) from the caller inherit the pipe, so the removal then waits for them too.
    """
    path = job_cache_dir(job_id, root)
    return subprocess.Popen(
        [sys.executable, "-I", "-c", _JANITOR],
        # the path goes through the environment: argv is visible to every user, and the name is private
        env={**os.environ, "CHECKPOINTLESS_JANITOR_PATH": str(path)},
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the launcher's process group must not kill it first
    )
