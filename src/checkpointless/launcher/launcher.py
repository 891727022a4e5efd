"""``checkpointless run`` on one machine: the coordinator and this host's agent in one process.

This module is the shell around them, and the only part that does I/O for the job as a whole: it
creates the run directory, the secret and the event log, serves the control channel, starts the
reaper, runs the loop that feeds the :class:`~checkpointless.coordinator.Coordinator` what
happened (worker messages, process exits, process-table verdicts, time) and carries out the
commands it returns through the :class:`~checkpointless.agent.Agent` (start and kill processes)
and the control channel (messages), and takes everything down at the end. The decisions live in
the coordinator, the process handling in the agent. The loop itself is the
:class:`~checkpointless.launcher.loop.DecisionLoop` mixin's (``loop.py``); remote agents and the
coordinator's succession are the :class:`~checkpointless.launcher.agents.AgentHosts` mixin's
(``agents.py``), which the loop builds on; the job's settings as JSON for them are
``model.config_to_json`` and ``model.config_from_json``.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from checkpointless.agent import Agent, AgentConfig
from checkpointless.config import ENV
from checkpointless.coordinator import Coordinator
from checkpointless.events import EventLog, get_logger, setup_logging
from checkpointless.launcher.agents import _beat_agents
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.loop import DecisionLoop
from checkpointless.launcher.model import LaunchConfig, checkpoint_root, config_from_json, config_to_json
from checkpointless.launcher.policy import Limits
from checkpointless.launcher.reaper import cleanup_job, job_shm_dir
from checkpointless.launcher.runfiles import (
    COORDINATOR_FILE,
    forget_coordinator,
    make_run_dir,
    record_coordinator,
    remove_early,
    write_secret,
)
from checkpointless.observe.hooks import start_observers
from checkpointless.protocol.agent_link import local_node
from checkpointless.state.checkpoint_dir import remove_partial

# config_from_json and config_to_json live in model.py now; still importable from here
__all__ = ["LaunchConfig", "Launcher", "config_from_json", "config_to_json"]

log = get_logger()


class Launcher(DecisionLoop):
    def __init__(self, cfg: LaunchConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.job_id = secrets.token_hex(6)
        self.secret = secrets.token_hex(32).encode()
        self.run_dir = cfg.run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{self.job_id}"
        self._created_run_dir = make_run_dir(self.run_dir)
        self.secret_file = self.run_dir / "secret"
        write_secret(self.secret_file, self.secret)
        # a record left by an earlier job here that was killed outright (its secret gone, or the
        # write above would have refused) must not send this job's agents to a dead address
        (self.run_dir / COORDINATOR_FILE).unlink(missing_ok=True)
        # The job's /dev/shm name gets a random part that only our processes learn, through the
        # environment (never argv, which every user can read). Set here so the reaper, cleanup_job
        # and every worker (plain mode's too) inherit it: one launcher per process.
        self.shm_key = secrets.token_hex(16)
        os.environ[ENV.SHM_KEY] = self.shm_key
        try:
            self.events = EventLog(self.run_dir / "events.jsonl", job=self.job_id)
        except BaseException:
            remove_early(self.run_dir, self._created_run_dir, self.secret_file)
            raise
        local = 0 if cfg.local_agent else None  # the embedded agent is host 0
        self._init_loop(term=0, local_host=local, next_host=1 if cfg.local_agent else 0)

    def _init_loop(self, *, term: int, local_host: int | None, next_host: int) -> None:
        """The supervision loop's state, from one place for the launcher and a takeover (which has no
        `__init__` of ours to run: its run directory, secret and key exist already)."""
        self.stopping: str | None = None
        self.exit_code = 0
        self._signal: int | None = None
        self._last_event = 0.0  # monotonic time of the loop's last event (policy.loop_wait)
        self.agent: Agent | None = None
        self.coordinator: Coordinator | None = None
        self._conns: dict[int, Connection] = {}  # worker id -> its control connection
        self._agents: dict[int, Connection] = {}  # agent (host) id -> a remote agent's connection
        self._agent_of: dict[Connection, int] = {}
        self._next_host = next_host
        self._local_host = local_host  # the embedded agent's id
        self._beat_stop = threading.Event()
        # coordinator failover (docs/architecture.md): this coordinator's term, each agent's
        # failover address, and whether it stepped down (its processes are left to the agents)
        self.term = term
        self._failover: dict[int, str] = {}
        # each agent's node name, to refuse a second agent for a live host (agents.claimed_host);
        # the hosts a successor inherits are unknown, and never claimed
        self._node: dict[int, str] = {} if local_host is None else {local_host: local_node()}
        self._stepped_down = False
        self._announced: list[int] = []  # the membership last sent to everyone
        self.reaper: subprocess.Popen[bytes] | None = None

    # -- entry point ---------------------------------------------------------------------------
    def run(self) -> int:
        setup_logging("launcher")
        try:
            # metrics and progress only listen to the events (observe/hooks.py)
            self.observers = start_observers(
                self.run_dir, self.events, self.cfg.host, self.cfg.metrics_port, self.cfg.progress
            )
            self.server = ControlServer(self.cfg.host, self.cfg.control_port, self.secret)
            self.server.start()
            record_coordinator(self.run_dir, self.control_address)
            threading.Thread(
                target=_beat_agents, args=(self._agents, self._beat_stop), daemon=True, name="cl-agent-beat"
            ).start()
            if self.cfg.local_agent:
                # With agents on every host there is nothing here for a reaper to kill: each agent
                # owns its processes and fences them, and a reaper that cleaned up after a lost
                # coordinator would end the job that a failover is about to save.
                reaper = [sys.executable, "-m", "checkpointless.launcher.reaper", str(self.run_dir)]
                self.reaper = subprocess.Popen(
                    [*reaper, self.job_id, self.control_address],
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                )
            self.store_desc = self._make_rendezvous()
            if self.cfg.local_agent:
                self.agent = Agent(self._agent_config(), self._job_env(), self.events)
                if not self.cfg.plain:
                    self.agent.start()
        except BaseException:
            self._undo_early()
            raise
        old_int = signal.signal(signal.SIGINT, self._on_signal)
        old_term = signal.signal(signal.SIGTERM, self._on_signal)
        log.info(
            "job %s: %d workers + %s running %s; run dir %s",
            self.job_id,
            self.cfg.nproc,
            "restarts on a fault (--plain)" if self.cfg.plain else f"{self.cfg.spares} spares",
            self.cfg.script,
            self.run_dir,
        )
        self.events.emit(
            "job_start",
            nproc=self.cfg.nproc,
            spares=self.cfg.spares,
            script=self.cfg.script,
            pid=os.getpid(),  # with host: lets `checkpointless status` tell a live launcher from a dead one
            host=socket.gethostname(),
            shm=str(job_shm_dir(self.job_id)),  # private to this user: events.jsonl is 0600 in a 0700 dir
        )
        try:
            if self.cfg.plain:
                from checkpointless.launcher.plain import run_plain

                self.exit_code = run_plain(self, self.cfg.max_restarts)
                self.stopping = "plain"
                return self.exit_code
            self.coordinator = Coordinator(
                self.cfg,
                self.job_id,
                self.store_desc,
                str(checkpoint_root(self.cfg, self.run_dir, self.job_id)),
            )
            if self.cfg.local_agent:
                self.coordinator.add_host(0, self.cfg.host, False, time.monotonic())
            if self.cfg.agents_needed > (1 if self.cfg.local_agent else 0) and not self._gather_agents():
                return self.exit_code
            self.coordinator.start(time.monotonic())
            self._execute()
            self._loop()
        except Exception as e:  # a launcher bug must still leave nothing behind
            if self.coordinator is not None:
                self.coordinator.fail(f"launcher error: {type(e).__name__}: {e}")
                self._execute()
            raise
        finally:
            # shut down under our own handlers: a second Ctrl-C must not cut the clean-up short
            self._shutdown()
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
        return self.exit_code

    def _agent_config(self) -> AgentConfig:
        c = self.cfg
        return AgentConfig(
            python=c.python,
            script=c.script,
            script_args=list(c.script_args),
            host=c.host,
            run_dir=self.run_dir,
            nproc=c.nproc,
            rendezvous=c.rendezvous,
            port_base=c.port_base,
            port_range=c.port_range,
            limits=Limits(hang_timeout=c.hang_timeout, start_timeout=c.start_timeout),
            quiet_workers=c.quiet_workers,
            fork_server=c.fork_server,
        )

    def _job_env(self) -> dict[str, str]:
        """What every process of the job has in its environment (the fork template too)."""
        env = dict(os.environ)
        env.update(
            {
                ENV.CONTROL: self.control_address,
                ENV.SECRET_FILE: str(self.secret_file),
                ENV.RUN_DIR: str(self.run_dir),
                ENV.JOB_ID: self.job_id,
                ENV.HOST: self.cfg.host,
                ENV.SHM_KEY: self.shm_key,
                "PYTHONUNBUFFERED": "1",
                # gloo reads all peers' addresses in one batched request per owner
                "GLOO_ENABLE_STORE_V2_API": "1",
            }
        )
        # N workers each running as many compute threads as there are cores oversubscribe the
        # machine many times over (torchrun sets 1 for the same reason); the user's value wins
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.cfg.nproc)))
        return env

    def _undo_early(self) -> None:
        """A launch that failed before any worker started takes back what it created."""
        observers = getattr(self, "observers", None)
        if observers is not None:
            observers.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
        if self.agent is not None:
            self.agent.close(grace=0)
        reaper = getattr(self, "reaper", None)
        if reaper is not None and reaper.stdin is not None:
            reaper.stdin.close()  # the reaper cleans up and exits at end-of-file
            try:
                reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait(timeout=5)
        self.events.close()
        remove_early(self.run_dir, self._created_run_dir, self.secret_file)

    @property
    def control_address(self) -> str:
        """Where this coordinator's control server listens, as agents and workers reach it."""
        return f"{self.server.address[0]}:{self.server.address[1]}"

    def _make_rendezvous(self) -> dict[str, Any]:
        if self.cfg.rendezvous == "rootless":
            return {"kind": "rootless", "timeout": self.cfg.recovery_timeout}
        import torch.distributed as dist  # only the store-based fallback pays for this import

        # The TCP store authenticates nobody, so it must at least listen on the job's interface
        # only (torch would bind every interface): bind the socket ourselves and hand it over.
        listener = socket.create_server((self.cfg.host, 0), backlog=512)
        self._tcp_store_listener = listener  # owned by us; closed with the launcher
        self._tcp_store = dist.TCPStore(
            self.cfg.host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        return {
            "kind": "tcp",
            "host": self.cfg.host,
            "port": self._tcp_store.port,
            "timeout": self.cfg.recovery_timeout,
        }

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum
        # A signal ends the job: its secret goes now, not when the loop gets to the shutdown.
        # A scheduler's SIGKILL can follow within seconds (scancel: KillWait, 2 s on some
        # clusters), and the loop may be in a send to a slow peer (up to 5 s); this handler
        # runs at once even then (Python runs it before retrying an interrupted call).
        if not self._stepped_down:
            try:
                self.secret_file.unlink(missing_ok=True)
            except OSError:
                pass
            if getattr(self, "server", None) is not None:
                forget_coordinator(self.run_dir, self.control_address)

    # -- the end -------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Stop every process we started, remove shared memory, close the watchdog."""
        if self._stepped_down:
            # not the end of the job: the processes belong to the agents and the successor
            self._beat_stop.set()
            self.server.stop()
            self.observers.close()
            self.events.close()
            return
        if self.coordinator is not None and self.stopping is None:
            self.coordinator.fail("the launcher stopped")  # sends every process its shutdown
            self._execute()
        if self.agent is not None:
            self.agent.close(grace=3.0)
        self._release_agents(grace=8.0)
        self._beat_stop.set()
        self.server.stop()
        self.observers.close()
        forget_coordinator(self.run_dir, self.control_address)
        cleanup_job(self.run_dir, self.job_id)
        remove_partial(checkpoint_root(self.cfg, self.run_dir, self.job_id))  # checkpoints stay, .tmp go
        if self.reaper is not None:
            if self.reaper.stdin is not None:
                self.reaper.stdin.close()
            try:
                self.reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
        self.events.close()
