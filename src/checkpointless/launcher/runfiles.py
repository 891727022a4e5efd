"""The launcher's private files: the run directory, the per-job secret, and the record of where
the job's coordinator listens now.

The secret authenticates every socket of the job, so whoever reads it can drive the job. It is
therefore created fresh (``O_EXCL``: never a file someone pre-created with a looser mode), without
following a symlink (``O_NOFOLLOW``: never written into a file someone else pointed us at), and
0600 in a 0700 directory that this user owns. A launch that fails before the job starts takes
back what it created, so no secret outlives a launch that never ran.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from pathlib import Path

from checkpointless.errors import ConfigError
from checkpointless.events import get_logger

__all__ = [
    "COORDINATOR_FILE",
    "forget_coordinator",
    "make_run_dir",
    "record_coordinator",
    "recorded_coordinator",
    "remove_early",
    "write_secret",
]

# The run directory's record of the current coordinator's control address, "HOST:PORT": written
# by the coordinator as it starts and by every successor as it takes over (agent/failover.py), so
# that an agent started later (a recreated pod, a healed node) finds the job after a failover,
# when the address it was given is the lost coordinator's. Next to the secret: an agent reads it
# from its --secret-file's directory.
COORDINATOR_FILE = "coordinator"
log = get_logger()
_MAX_RECORD = 300  # a host name (253) and a port: more is not a record of ours
# a host name, an IPv4 address or an IPv6 one (with its zone), then the port
_RECORD = re.compile(rb"([A-Za-z0-9._%:\[\]-]+):([0-9]{1,5})")


def make_run_dir(path: Path) -> bool:
    """Create ``path`` 0700, or accept it if it is already a directory of this user.

    Returns whether it was created here (then an early failure may remove it again). A symlink,
    a non-directory, or a directory owned by someone else is refused with a :class:`ConfigError`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    created = True
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        created = False
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"run directory {path} is a symlink or not a directory; choose another --run-dir")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"run directory {path} belongs to uid {st.st_uid}, not to this user; choose another --run-dir"
        )
    return created


def write_secret(path: Path, secret: bytes) -> None:
    """Write the job secret to a new 0600 file; refuse an existing file or symlink."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError as e:
        raise ConfigError(
            f"{path} already exists (a running job's secret, a stale one, or a planted file); "
            "the launcher writes a fresh secret only: remove it or choose another --run-dir"
        ) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
    except BaseException:
        path.unlink(missing_ok=True)  # never leave half a secret behind
        raise


def record_coordinator(run_dir: Path, address: str) -> bool:
    """Record ``address`` as the job's coordinator: written whole to a temporary file of a name
    no other writer uses (pods share a pid on a shared volume), then renamed over the record, so
    a reader sees the old address or the new one, never a part. Returns whether it was recorded.

    Best effort: the record is a hint for agents that start later, and a job (a takeover that
    just saved it, above all) must not end because a shared volume refused a small file."""
    final = run_dir / COORDINATOR_FILE
    tmp = run_dir / f".{COORDINATOR_FILE}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(address + "\n")
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as e:
        log.warning(
            "could not record the coordinator's address in %s (%s); agents that start later need "
            "its address in --coordinator",
            final,
            e,
        )
        return False
    return True


def recorded_coordinator(path: Path) -> str | None:
    """The address in a coordinator record, or None when there is none or it is not one. The
    file is read as what it must be, a small regular file: never through a symlink, never a
    FIFO or a device that could block the reader, never more than a record's length. Its
    content is trusted no further than its form: a connection there is still sealed with the
    job's secret."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _MAX_RECORD + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    match = _RECORD.fullmatch(raw.strip()) if len(raw) <= _MAX_RECORD else None
    if match is None or not 0 < int(match[2]) < 65536:
        return None
    return raw.strip().decode("ascii")


def forget_coordinator(run_dir: Path, address: str) -> None:
    """Remove the record as the job ends, if it is still this coordinator's: a coordinator that
    stepped down must not remove its successor's. (Read, then removed: a successor that writes
    in between is one elected while this coordinator was ending the job, which cannot be.)"""
    path = run_dir / COORDINATOR_FILE
    if recorded_coordinator(path) == address:
        with contextlib.suppress(OSError):
            path.unlink()


def remove_early(run_dir: Path, created: bool, secret_file: Path) -> None:
    """Undo a launch that failed before the job started: the secret, the coordinator record, an
    empty event log, and the run directory if this launch created it and nothing else is in it."""
    secret_file.unlink(missing_ok=True)
    (run_dir / COORDINATOR_FILE).unlink(missing_ok=True)
    events = run_dir / "events.jsonl"
    with contextlib.suppress(OSError):
        if events.stat().st_size == 0:
            events.unlink()
    if created:
        with contextlib.suppress(OSError):  # not empty: something worth keeping is in there
            run_dir.rmdir()
