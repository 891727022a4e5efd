"""``checkpointless run`` on one machine: the coordinator and this host's agent in one process.

This module is the shell around them for a new job, and the only part that does I/O for the job
as a whole: it creates the run directory, the secret and the event log, serves the control
channel, starts the reaper and the embedded :class:`~checkpointless.agent.Agent`, and then runs
either the plain shell (``--plain``: :class:`~checkpointless.launcher.plain.PlainShell`) or a
coordinator's term (:class:`~checkpointless.launcher.shell.CoordinatorShell`: the
:class:`~checkpointless.coordinator.Coordinator` decides, the
:class:`~checkpointless.launcher.loop.DecisionLoop` feeds it and carries out its commands, the
:class:`~checkpointless.launcher.agents.AgentHosts` keep the remote agents), and takes everything
down at the end. The job's settings as JSON for the agents are ``model.config_to_json`` and
``model.config_from_json``.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from checkpointless.agent import Agent, AgentConfig
from checkpointless.config import ENV
from checkpointless.errors import ConfigError
from checkpointless.events import EventLog, get_logger, setup_logging
from checkpointless.launcher.control import ControlServer
from checkpointless.launcher.identity import JobIdentity
from checkpointless.launcher.model import LaunchConfig, config_from_json, config_to_json
from checkpointless.launcher.plain import PlainShell
from checkpointless.launcher.reaper import job_shm_dir
from checkpointless.launcher.runfiles import (
    COORDINATOR_FILE,
    make_run_dir,
    record_coordinator,
    remove_early,
    write_secret,
)
from checkpointless.launcher.shell import CoordinatorShell, NoObservers, StartObservers
from checkpointless.launcher.store import JobStore

# config_from_json and config_to_json live in model.py now; still importable from here
__all__ = ["LaunchConfig", "Launcher", "config_from_json", "config_to_json"]

log = get_logger()


class Launcher:
    """A new job: its run directory and secret, then its coordinator (or plain shell) until it ends.

    ``start_observers`` starts what watches the job for ``--metrics-port`` and ``--progress``; the
    command line passes ``observe.hooks.start_observers`` (the launcher imports no optional tool).
    Without it, a job that asks for either is refused."""

    def __init__(self, cfg: LaunchConfig, start_observers: StartObservers | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self._start_observers = start_observers
        job_id = secrets.token_hex(6)
        run_dir = cfg.run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{job_id}"
        self._created_run_dir = make_run_dir(run_dir)
        secret = secrets.token_hex(32).encode()
        secret_file = run_dir / "secret"
        write_secret(secret_file, secret)
        # a record left by an earlier job here that was killed outright (its secret gone, or the
        # write above would have refused) must not send this job's agents to a dead address
        (run_dir / COORDINATOR_FILE).unlink(missing_ok=True)
        # The job's /dev/shm name gets a random part that only our processes learn, through the
        # environment (never argv, which every user can read). Set here so the reaper, cleanup_job
        # and every worker (plain mode's too) inherit it: one launcher per process.
        shm_key = secrets.token_hex(16)
        os.environ[ENV.SHM_KEY] = shm_key
        self.job = JobIdentity(job_id, secret, secret_file, run_dir, shm_key)
        try:
            events = EventLog(run_dir / "events.jsonl", job=job_id)
        except BaseException:
            remove_early(run_dir, self._created_run_dir, secret_file)
            raise
        self.shell = CoordinatorShell(cfg, self.job, events)

    # -- entry point ---------------------------------------------------------------------------
    def run(self) -> int:
        setup_logging("launcher")
        cfg, job, shell = self.cfg, self.job, self.shell
        try:
            # metrics and progress only listen to the events (observe/hooks.py, given by cli.py)
            if self._start_observers is not None:
                shell.observers = self._start_observers(
                    job.run_dir, shell.events, cfg.host, cfg.metrics_port, cfg.progress
                )
            elif cfg.metrics_port is not None or cfg.progress is not None:
                raise ConfigError(
                    "--metrics-port and --progress need the observers, which this launcher was not "
                    "given (Launcher(cfg, start_observers=observe.hooks.start_observers))"
                )
            else:
                shell.observers = NoObservers()
            shell.server = ControlServer(cfg.host, cfg.control_port, job.secret)
            shell.server.start()
            record_coordinator(job.run_dir, shell.control_address)
            if cfg.local_agent:
                # With agents on every host there is nothing here for a reaper to kill: each agent
                # owns its processes and fences them, and a reaper that cleaned up after a lost
                # coordinator would end the job that a failover is about to save.
                reaper = [sys.executable, "-m", "checkpointless.launcher.reaper", str(job.run_dir)]
                shell.reaper = subprocess.Popen(
                    [*reaper, job.job_id, shell.control_address],
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                )
            shell.store = JobStore(cfg)
            if cfg.local_agent:
                shell.agent = Agent(self._agent_config(), self._job_env(), shell.events)
                if not cfg.plain:
                    shell.agent.start()
        except BaseException:
            shell.undo_early(self._created_run_dir)
            raise
        with shell.signals_handled():
            log.info(
                "job %s: %d workers + %s running %s; run dir %s",
                job.job_id,
                cfg.nproc,
                "restarts on a fault (--plain)" if cfg.plain else f"{cfg.spares} spares",
                cfg.script,
                job.run_dir,
            )
            shell.events.emit(
                "job_start",
                nproc=cfg.nproc,
                spares=cfg.spares,
                script=cfg.script,
                pid=os.getpid(),  # with host: lets `checkpointless status` tell a live launcher from a dead one
                host=socket.gethostname(),
                shm=str(job_shm_dir(job.job_id)),  # private to this user: events.jsonl is 0600 in a 0700 dir
            )
            try:
                self._supervise()
            except Exception as e:  # a launcher bug must still leave nothing behind
                shell.fail(f"launcher error: {type(e).__name__}: {e}")
                raise
            finally:
                # shut down under our own handlers: a second Ctrl-C must not cut the clean-up short
                shell.shutdown()
        return shell.outcome.code

    def _supervise(self) -> None:
        cfg, shell = self.cfg, self.shell
        if cfg.plain:
            assert shell.agent is not None
            code = PlainShell(cfg, self.job, shell.events, shell.agent, shell.outcome).run(cfg.max_restarts)
            shell.outcome.stop("plain", code)
            return
        # the embedded agent is host 0
        local = 0 if cfg.local_agent else None
        loop = shell.start_term(term=0, local_host=local, next_host=1 if cfg.local_agent else 0)
        coord = loop.coordinator
        if cfg.local_agent:
            coord.add_host(0, cfg.host, False, time.monotonic())
        if cfg.agents_needed > (1 if cfg.local_agent else 0) and not loop.wait_for_agents():
            return
        coord.start(time.monotonic())
        loop.execute()
        loop.run()

    def _agent_config(self) -> AgentConfig:
        c = self.cfg
        return AgentConfig.from_job(c, python=c.python, host=c.host, run_dir=self.job.run_dir, nproc=c.nproc)

    def _job_env(self) -> dict[str, str]:
        """What every process of the job has in its environment (the fork template too)."""
        job = self.job
        env = dict(os.environ)
        env.update(
            {
                ENV.CONTROL: self.shell.control_address,
                ENV.SECRET_FILE: str(job.secret_file),
                ENV.RUN_DIR: str(job.run_dir),
                ENV.JOB_ID: job.job_id,
                ENV.HOST: self.cfg.host,
                ENV.SHM_KEY: job.shm_key,
                "PYTHONUNBUFFERED": "1",
                # gloo reads all peers' addresses in one batched request per owner
                "GLOO_ENABLE_STORE_V2_API": "1",
            }
        )
        # N workers each running as many compute threads as there are cores oversubscribe the
        # machine many times over (torchrun sets 1 for the same reason); the user's value wins
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.cfg.nproc)))
        return env
