"""Tier 0: the launcher for a script that has not adopted checkpointless at all.

Such a script cannot recover in place (it holds no Step to replay and registers no state), so a
fault restarts the whole group, as ``torchrun --max-restarts`` does; the script's own checkpoints
decide what is lost. What it gains without a code change: torchrun-compatible environment
variables, root-less start-up (``init_process_group`` over ``env://`` gets a store where every
rank serves its own keys, see ``boot/sitecustomize.py``), fault and restart events, and the same
clean-up guarantees as the full launcher.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from checkpointless.agent import Agent
from checkpointless.config import ENV
from checkpointless.coordinator.rules.fatal import exit_verdict
from checkpointless.events import EventLog, get_logger, open_private_append
from checkpointless.launcher.identity import JobIdentity
from checkpointless.launcher.model import LaunchConfig
from checkpointless.launcher.outcome import Outcome
from checkpointless.launcher.reaper import cleanup_job

__all__ = ["PlainShell"]

log = get_logger()
_BOOT = Path(__file__).resolve().parent / "boot"


class PlainShell:
    """Runs ``cfg.script`` on ``cfg.nproc`` processes, restarting all of them on a fault.

    The launcher's shell hands it what it set up (the job's identity, its event log, the
    embedded agent for the ranks' listening sockets) and the :class:`Outcome` its signal handler
    writes to.
    """

    def __init__(
        self, cfg: LaunchConfig, job: JobIdentity, events: EventLog, agent: Agent, outcome: Outcome
    ) -> None:
        self.cfg = cfg
        self.job = job
        self.events = events
        self.agent = agent
        self.outcome = outcome

    def run(self, max_restarts: int) -> int:
        """The job's exit code once it finished, failed past ``max_restarts`` or got a signal."""
        # The launcher keeps every rank's listening socket for the whole job and hands it to each
        # attempt: no other job can take the port between restarts, and a rank whose key server
        # is not up yet has its peers' connections queued rather than refused.
        listeners = [self.agent.bind_store_port() for _ in range(self.cfg.nproc)]
        try:
            return self._attempts(listeners, max_restarts)
        finally:
            for sock in listeners:
                sock.close()

    def _attempts(self, listeners: list[socket.socket], max_restarts: int) -> int:
        cfg, events = self.cfg, self.events
        attempt = 0
        while True:
            procs = self._start(listeners, attempt)
            events.emit("plain_start", attempt=attempt, pids=[p.pid for p in procs])
            failed: tuple[int, int] | None = None
            while True:
                signum = self.outcome.signal
                if signum is not None:
                    _kill_all(procs)
                    events.emit("job_end", status="failed", error=f"signal {signum}", restarts=attempt)
                    return 128 + int(signum)
                # Every exit code is read before the loop may end: processes that all failed
                # between two looks must not pass for a job that finished.
                codes = [p.poll() for p in procs]
                failed = next(((rank, c) for rank, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is not None or all(c == 0 for c in codes):
                    break
                time.sleep(0.05)
            if failed is None:
                events.emit("job_end", status="ok", restarts=attempt)
                log.info("job finished after %d restart(s)", attempt)
                return 0
            rank, code = failed
            what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            events.emit("fault", rank=rank, kind="exit", detail=what, attempt=attempt)
            # a ConfigError (its own exit status, run_script.py): a restart would raise it again
            fatal = exit_verdict(f"rank {rank}", code, True, False, cfg.script)
            if fatal is not None:
                _kill_all(procs)
                events.emit("job_end", status="failed", error=fatal, restarts=attempt)
                log.error("%s", fatal)
                return 1
            log.warning("FAULT rank %d: %s; restarting all %d processes (plain mode)", rank, what, cfg.nproc)
            _kill_all(procs)
            cleanup_job(self.job.run_dir, self.job.job_id, keep_secret=True)
            attempt += 1
            if attempt > max_restarts:
                events.emit("job_end", status="failed", restarts=attempt - 1)
                log.error("giving up after %d restart(s) (--max-restarts %d)", attempt - 1, max_restarts)
                return 1
            events.emit("restart", attempt=attempt)

    def _start(self, listeners: list[socket.socket], attempt: int) -> list[subprocess.Popen[bytes]]:
        """One attempt's processes, one per rank."""
        cfg, job = self.cfg, self.job
        ports = [sock.getsockname()[1] for sock in listeners]
        peers = ",".join(f"{cfg.host}:{p}" for p in ports)
        procs: list[subprocess.Popen[bytes]] = []
        for rank in range(cfg.nproc):
            env = dict(os.environ)
            env.update(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(cfg.nproc),
                    "LOCAL_WORLD_SIZE": str(cfg.nproc),
                    "GROUP_RANK": "0",
                    "MASTER_ADDR": cfg.host,  # for scripts that read it; no store listens there
                    "MASTER_PORT": str(ports[0]),
                    "TORCHELASTIC_RESTART_COUNT": str(attempt),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(_BOOT), env.get("PYTHONPATH", "")])),
                    "CHECKPOINTLESS_PLAIN": "1",
                    "CHECKPOINTLESS_PEERS": peers,
                    "CHECKPOINTLESS_ATTEMPT": str(attempt),
                    ENV.SECRET_FILE: str(job.secret_file),
                    ENV.JOB_ID: job.job_id,
                    ENV.STORE_PORT: str(ports[rank]),
                    ENV.STORE_FD: str(listeners[rank].fileno()),
                    ENV.HOST: cfg.host,
                    "PYTHONUNBUFFERED": "1",
                }
            )
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
            # the script runs as __main__, unchanged, and its process ends without the
            # interpreter teardown that can abort it after it has finished (run_script.py); a
            # session of its own, as torchrun gives it (launcher/forkserver.py says why)
            p = subprocess.Popen(
                [cfg.python, "-m", "checkpointless.launcher.run_script", cfg.script, *cfg.script_args],
                env=env,
                pass_fds=(listeners[rank].fileno(),),
                start_new_session=True,
            )
            with open(open_private_append(job.run_dir / "pids"), "w") as f:
                f.write(f"{p.pid}\n")
            procs.append(p)
        return procs


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=10)
