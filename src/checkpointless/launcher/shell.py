"""What every coordinator's shell has and does, whether it started the job or took it over.

:class:`CoordinatorShell` owns the resources of one coordinator's process (the control server, the
observers, the embedded agent, the reaper, the rendezvous) and, once the coordinator exists, its
three parts: the :class:`~checkpointless.coordinator.Coordinator` (the decisions), the
:class:`~checkpointless.launcher.agents.AgentHosts` (the remote agents and the succession) and the
:class:`~checkpointless.launcher.loop.DecisionLoop` (observations in, commands out). It handles
the signals that end the job and takes everything down at the end. The two shells that use it
fill in the resources as they make them: ``launcher.py`` (a new job) and ``takeover.py`` (a
coordinator elected after a failover).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from checkpointless.agent import Agent
from checkpointless.coordinator import Coordinator
from checkpointless.events import EventLog
from checkpointless.launcher.agents import AgentHosts
from checkpointless.launcher.control import ControlServer
from checkpointless.launcher.identity import JobIdentity
from checkpointless.launcher.loop import DecisionLoop
from checkpointless.launcher.model import LaunchConfig, checkpoint_root
from checkpointless.launcher.outcome import Outcome
from checkpointless.launcher.policy import signal_ends_the_job
from checkpointless.launcher.reaper import cleanup_job
from checkpointless.launcher.runfiles import (
    COORDINATOR_FILE,
    forget_coordinator,
    recorded_coordinator,
    remove_early,
)
from checkpointless.launcher.store import JobStore
from checkpointless.protocol.agent_link import local_node
from checkpointless.state.checkpoint_dir import remove_partial

__all__ = ["CoordinatorShell", "NoObservers", "Observers", "StartObservers"]

_REAPER_WAIT_S = 5.0


class Observers(Protocol):
    """What runs beside the job only to watch it (``--metrics-port``, ``--progress``); closed at
    the end. The optional tools make it (``observe/hooks.py``); the launcher imports none of them."""

    def close(self) -> None: ...


# (run dir, event log, host, --metrics-port, --progress) -> the observers started. The command
# line passes observe.hooks.start_observers to the Launcher (dependency injection).
StartObservers = Callable[[Path, EventLog, str, int | None, float | None], Observers]


class NoObservers:
    """Nothing beside the job: what a coordinator elected after a failover runs (no metrics, no
    progress), and a launcher that was given no observers."""

    def close(self) -> None:
        """Nothing to stop."""


def stop_reaper(reaper: subprocess.Popen[bytes]) -> None:
    """The reaper cleans up and exits at end-of-file on its input; one that does not is killed."""
    if reaper.stdin is not None:
        reaper.stdin.close()
    try:
        reaper.wait(timeout=_REAPER_WAIT_S)
    except subprocess.TimeoutExpired:
        reaper.kill()


class CoordinatorShell:
    """The resources and parts of one coordinator's process; each None until it is made."""

    def __init__(
        self,
        cfg: LaunchConfig,
        job: JobIdentity,
        events: EventLog,
        *,
        server: ControlServer | None = None,
        agent: Agent | None = None,
    ) -> None:
        self.cfg = cfg
        self.job = job
        self.events = events
        self.outcome = Outcome()
        self.server = server
        self.agent = agent  # the embedded agent: this host's processes
        self.observers: Observers | None = None
        self.reaper: subprocess.Popen[bytes] | None = None
        self.store: JobStore | None = None
        self.coordinator: Coordinator | None = None
        self.hosts: AgentHosts | None = None
        self.loop: DecisionLoop | None = None

    @property
    def control_address(self) -> str:
        """Where this coordinator's control server listens, as agents and workers reach it."""
        assert self.server is not None
        return f"{self.server.address[0]}:{self.server.address[1]}"

    # -- the parts -----------------------------------------------------------------------------
    def start_term(
        self,
        *,
        term: int,
        local_host: int | None,
        next_host: int,
        on_executed: Callable[[], None] | None = None,
    ) -> DecisionLoop:
        """Make the coordinator of ``term``, its agent hosts and its decision loop.

        ``local_host``: the embedded agent's host id; ``next_host``: the id the next agent to join
        gets (a takeover's are ids no member ever had: a fenced member may rejoin)."""
        assert self.server is not None and self.store is not None
        cfg, job = self.cfg, self.job
        coord = self.coordinator = Coordinator(
            cfg, job.job_id, self.store.description, str(checkpoint_root(cfg, job.run_dir, job.job_id))
        )
        nodes = {} if local_host is None else {local_host: local_node()}
        self.hosts = AgentHosts(
            cfg,
            job,
            self.server,
            coord,
            self.events,
            self.outcome,
            term=term,
            next_host=next_host,
            nodes=nodes,
        )
        self.hosts.start_beats()
        self.loop = DecisionLoop(
            cfg,
            coord,
            self.server,
            self.hosts,
            self.events,
            self.outcome,
            local=self.agent,
            local_host=local_host,
            on_executed=on_executed,
        )
        return self.loop

    def fail(self, why: str) -> None:
        """The coordinator (if there is one yet) ends the job, and its commands are carried out."""
        if self.coordinator is not None and self.loop is not None:
            self.coordinator.fail(why)
            self.loop.execute()

    # -- signals -------------------------------------------------------------------------------
    @contextmanager
    def signals_handled(self) -> Iterator[None]:
        """SIGINT and SIGTERM end the job while inside; the old handlers come back after."""
        old_int = signal.signal(signal.SIGINT, self.on_signal)
        old_term = signal.signal(signal.SIGTERM, self.on_signal)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)

    def on_signal(self, signum: int, frame: Any) -> None:
        self.outcome.signal = signum
        # A signal ends the job: its secret goes now, not when the loop gets to the shutdown.
        # A scheduler's SIGKILL can follow within seconds (scancel: KillWait, 2 s on some
        # clusters), and the loop may be in a send to a slow peer (up to 5 s); this handler
        # runs at once even then (Python runs it before retrying an interrupted call).
        own = self.control_address if self.server is not None else ""
        recorded = recorded_coordinator(self.job.run_dir / COORDINATOR_FILE)
        if signal_ends_the_job(self.outcome.stepped_down, recorded, own):
            try:
                self.job.secret_file.unlink(missing_ok=True)
            except OSError:
                pass
            if self.server is not None:
                forget_coordinator(self.job.run_dir, self.control_address)

    # -- the end -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every process we started, remove shared memory, close the watchdog."""
        assert self.server is not None and self.observers is not None
        if self.outcome.stepped_down:
            # not the end of the job: the processes belong to the agents and the successor
            if self.hosts is not None:
                self.hosts.stop_beats()
            self.server.stop()
            self.observers.close()
            self.events.close()
            return
        if self.outcome.stopping is None:
            self.fail("the launcher stopped")  # sends every process its shutdown
        if self.agent is not None:
            self.agent.close(grace=3.0)
        if self.hosts is not None:
            self.hosts.release(grace=8.0)
            self.hosts.stop_beats()
        self.server.stop()
        self.observers.close()
        forget_coordinator(self.job.run_dir, self.control_address)
        cleanup_job(self.job.run_dir, self.job.job_id)
        remove_partial(
            checkpoint_root(self.cfg, self.job.run_dir, self.job.job_id)
        )  # checkpoints stay, .tmp go
        if self.reaper is not None:
            stop_reaper(self.reaper)
        self.events.close()

    def undo_early(self, created_run_dir: bool) -> None:
        """A launch that failed before any worker started takes back what it created."""
        if self.observers is not None:
            self.observers.close()
        if self.server is not None:
            self.server.stop()
        if self.agent is not None:
            self.agent.close(grace=0)
        if self.reaper is not None:
            stop_reaper(self.reaper)
            self.reaper.wait(timeout=_REAPER_WAIT_S)
        self.events.close()
        remove_early(self.job.run_dir, created_run_dir, self.job.secret_file)
