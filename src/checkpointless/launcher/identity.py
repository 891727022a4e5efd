"""Who a job is, as the coordinator's shell and its parts know it: its id, secret and files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["JobIdentity"]


@dataclass(frozen=True)
class JobIdentity:
    """What a coordinator's shell was given or made for its job, and hands to the parts it builds.

    A new job's launcher makes all of it (``launcher.py``); a coordinator that took over after a
    failover inherits it from the agent it runs in (``takeover.py``).
    """

    job_id: str
    secret: bytes  # the job's secret, from which every sealed channel derives its keys
    secret_file: Path  # where the job's processes read the secret
    run_dir: Path
    # the random part of the job's /dev/shm name that only the job's processes learn (through the
    # environment, never argv, which every user can read)
    shm_key: str
