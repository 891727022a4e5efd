"""Where a job's state lives in shared memory: snapshot directories and names, buddy copies.

Separate from the snapshot file format (``snapshot_file.py``) and its writer (``shm_snapshot.py``)
because recovery planning only asks where snapshots are and which steps they hold, and the
same-host buddy copies (``buddy_shm.py``) share the job's private directory without being
snapshots. Everything here lies inside the job's shared-memory directory, so the launcher's and
the reaper's clean-up remove it with the batch cache, even after a SIGKILL; every directory is
created private (owner only), since ``/dev/shm`` is shared by every user.

A published snapshot is ``snap-<step>.ckpl`` (the step zero-padded to 12 digits); any other name
in a snapshot directory (a writer's hidden ``.writing-<pid>`` file) is not a snapshot.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from checkpointless.data.shm_cache import job_cache_dir
from checkpointless.errors import ConfigError

__all__ = [
    "buddy_copy_dir",
    "list_snapshots",
    "newest_snapshot",
    "private_dir",
    "rank_snapshot_dir",
    "snapshot_dir",
    "snapshot_path",
]

_NAME = re.compile(r"^snap-(\d{12})\.ckpl$")


def snapshot_dir(job_id: str) -> Path:
    """Where a job's snapshots live: inside the job's shared-memory directory, so the launcher's
    and the reaper's clean-up remove them with the batch cache, even after a SIGKILL."""
    return job_cache_dir(job_id) / "snapshots"


def rank_snapshot_dir(job_id: str, rank: int) -> Path:
    """Where one rank's own snapshots live on a sharded mesh (each rank holds a different shard,
    so each writes its own, next to the others in the job's private directory). Created private."""
    top = snapshot_dir(job_id)
    private_dir(top)
    path = top / f"rank{rank}"
    private_dir(path)
    return path


def buddy_copy_dir(job_id: str) -> Path:
    """Where same-host buddy copies lie (state/buddy_shm.py), in the job's private directory so
    that the launcher's clean-up removes them too. Created private."""
    path = job_cache_dir(job_id) / "buddy"
    private_dir(path)
    return path


def snapshot_path(directory: Path, step: int) -> Path:
    return directory / f"snap-{step:012d}.ckpl"


def list_snapshots(directory: Path) -> list[int]:
    """Steps of the published (complete) snapshots in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_NAME.match, names) if m)


def newest_snapshot(directory: Path) -> int | None:
    steps = list_snapshots(directory)
    return steps[-1] if steps else None


def private_dir(path: Path) -> None:
    # /dev/shm is shared by every user: a directory planted by someone else could feed us state
    for d in (path.parent, path):
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ConfigError(
                f"{d}: not a private directory owned by this user; remove it and restart the job"
            )
