"""The launcher's watchdog: cleans up after a launcher that died without doing it itself.

Started by the launcher with a pipe on stdin. The launcher never writes to it; when the launcher
dies for any reason — SIGKILL included — the kernel closes the pipe, our read returns, and we kill
every process of the job that is still alive and remove the job's shared memory. A launcher that
ends normally has already done both, and then this finds nothing to do.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

from checkpointless.config import job_shm_name
from checkpointless.launcher.runfiles import forget_coordinator

__all__ = ["cleanup_job", "job_shm_dir", "main"]


def _belongs_to(pid: int, job_id: str) -> bool:
    # pids are reused: only kill a process whose environment names this job
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"CHECKPOINTLESS_JOB_ID={job_id}".encode() in environ.split(b"\0")


def job_shm_dir(job_id: str) -> Path:
    """The job's shared-memory directory on this host. The name's private part comes from our
    environment (CHECKPOINTLESS_SHM_KEY), never argv."""
    return Path(os.environ.get("CHECKPOINTLESS_SHM_DIR", "/dev/shm")) / job_shm_name(job_id)


def cleanup_job(run_dir: Path, job_id: str, keep_secret: bool = False) -> int:
    """Kill the job's leftover processes and remove its shared memory; return how many killed."""
    killed = 0
    pids_file = run_dir / "pids"
    if pids_file.exists():
        for line in pids_file.read_text().split():
            pid = int(line)
            if _belongs_to(pid, job_id):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
    shm = job_shm_dir(job_id)
    if shm.exists():
        shutil.rmtree(shm, ignore_errors=True)
    if not keep_secret:
        (run_dir / "secret").unlink(missing_ok=True)
    return killed


def main() -> int:
    run_dir, job_id, control = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which cleans up
    # A SIGTERM sent to every process of the job at once (scancel, a kill of the whole tree)
    # reaches us with the launcher's: dying on it would leave the launcher's own cleanup
    # unwatched, and a launcher killed before it finished would leave shared memory behind. We
    # end when the launcher does (end-of-file), and SIGKILL still ends us.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        sys.stdin.buffer.read()
    except (OSError, KeyboardInterrupt):
        pass
    cleanup_job(run_dir, job_id)
    # only while it names the launcher: with remote agents (run --nnodes) a successor may have
    # taken over after this launcher stepped down, and the record is then the successor's
    forget_coordinator(run_dir, control)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
