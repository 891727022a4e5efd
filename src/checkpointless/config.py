"""The environment contract between the launcher and the processes it starts.

The launcher passes everything a worker or spare needs through these variables; a script run
without the launcher sees none of them and runs as a single-process job.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from checkpointless.errors import ConfigError

__all__ = ["ENV", "WorkerEnv", "job_shm_name"]


class ENV:
    CONTROL = "CHECKPOINTLESS_CONTROL"  # host:port of the launcher's control channel
    SECRET_FILE = "CHECKPOINTLESS_SECRET_FILE"  # 0600 file holding the per-job secret
    WORKER_ID = "CHECKPOINTLESS_WORKER_ID"  # this process's incarnation number
    ROLE = "CHECKPOINTLESS_ROLE"  # worker | spare
    RUN_DIR = "CHECKPOINTLESS_RUN_DIR"
    JOB_ID = "CHECKPOINTLESS_JOB_ID"
    STORE_PORT = "CHECKPOINTLESS_STORE_PORT"  # port of this process's rendezvous key server
    STORE_FD = "CHECKPOINTLESS_STORE_FD"  # that port's socket, already bound by the launcher
    HOST = "CHECKPOINTLESS_HOST"  # address peers reach this process at
    SHM_KEY = "CHECKPOINTLESS_SHM_KEY"  # random part of the job's private /dev/shm name (never in argv)
    # set by `checkpointless audit` only: where each process appends its per-step fingerprints,
    # and the number of steps after which the loop ends (recovery/fingerprint.py)
    AUDIT_DIR = "CHECKPOINTLESS_AUDIT_DIR"
    AUDIT_STEPS = "CHECKPOINTLESS_AUDIT_STEPS"


_SHM_KEY = re.compile(r"^[0-9a-f]{16,64}$")


def job_shm_name(job_id: str) -> str:
    """The name of the job's directory in /dev/shm.

    Under the launcher, ``checkpointless-<uid>-<key>`` with the random key from
    ``$CHECKPOINTLESS_SHM_KEY``: the job id is visible to every user (in process lists), so a
    name derived from it alone could be pre-created or blocked by someone else. Without the
    variable (standalone use), ``checkpointless-<job_id>``.
    """
    key = os.environ.get(ENV.SHM_KEY)
    if key is None:
        return f"checkpointless-{job_id}"
    if not _SHM_KEY.match(key):
        raise ConfigError(
            f"{ENV.SHM_KEY}={key!r} must be 16-64 lowercase hex digits (the launcher sets it; "
            "unset it to name the cache after the job id)"
        )
    return f"checkpointless-{os.geteuid()}-{key}"


@dataclass(frozen=True)
class WorkerEnv:
    control: tuple[str, int]
    secret: bytes
    worker_id: int
    role: str
    run_dir: Path
    job_id: str
    store_port: int
    host: str
    store_fd: int | None = None

    @staticmethod
    def from_environ() -> WorkerEnv | None:
        """Read the contract; ``None`` when not started by the launcher."""
        if ENV.CONTROL not in os.environ:
            return None
        try:
            host, _, port = os.environ[ENV.CONTROL].rpartition(":")
            secret = Path(os.environ[ENV.SECRET_FILE]).read_bytes().strip()
            return WorkerEnv(
                control=(host, int(port)),
                secret=secret,
                worker_id=int(os.environ[ENV.WORKER_ID]),
                role=os.environ.get(ENV.ROLE, "worker"),
                run_dir=Path(os.environ[ENV.RUN_DIR]),
                job_id=os.environ[ENV.JOB_ID],
                store_port=int(os.environ.get(ENV.STORE_PORT, "0")),
                host=os.environ.get(ENV.HOST, "127.0.0.1"),
                store_fd=int(os.environ[ENV.STORE_FD]) if ENV.STORE_FD in os.environ else None,
            )
        except (KeyError, ValueError, OSError) as e:
            raise ConfigError(
                f"incomplete checkpointless launcher environment ({e}); start the script with "
                "`checkpointless run`, or without any CHECKPOINTLESS_* variables for a single process"
            ) from e
