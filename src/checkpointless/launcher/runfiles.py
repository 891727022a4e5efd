"""The launcher's private files: the run directory and the per-job secret.

The secret authenticates every socket of the job, so whoever reads it can drive the job. It is
therefore created fresh (``O_EXCL``: never a file someone pre-created with a looser mode), without
following a symlink (``O_NOFOLLOW``: never written into a file someone else pointed us at), and
0600 in a 0700 directory that this user owns. A launch that fails before the job starts takes
back what it created, so no secret outlives a launch that never ran.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from checkpointless.errors import ConfigError

__all__ = ["make_run_dir", "remove_early", "write_secret"]


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


def remove_early(run_dir: Path, created: bool, secret_file: Path) -> None:
    """Undo a launch that failed before the job started: the secret, an empty event log, and
    the run directory if this launch created it and nothing else is in it."""
    secret_file.unlink(missing_ok=True)
    events = run_dir / "events.jsonl"
    with contextlib.suppress(OSError):
        if events.stat().st_size == 0:
            events.unlink()
    if created:
        with contextlib.suppress(OSError):  # not empty: something worth keeping is in there
            run_dir.rmdir()
