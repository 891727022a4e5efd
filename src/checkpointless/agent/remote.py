"""``checkpointless agent``: one process per host that runs that host's workers and spares for a
coordinator elsewhere.

It connects to the coordinator's control server (sealed frames, the job's secret, one key per
direction, as the workers do), says :class:`~checkpointless.protocol.AgentHello`, and learns the
job from :class:`~checkpointless.protocol.AgentWelcome`. Then it carries out ``SpawnCmd`` and
``KillCmd`` with an :class:`~checkpointless.agent.Agent` and reports what its processes do
(``ProcStarted``, ``ProcExited``, ``ProcVerdict``). The workers themselves connect straight to the
coordinator: one hop for every abort and plan, and an agent that dies does not cut its host's
workers off from the decisions they are already part of.

Fencing: both sides send ``AgentHeartbeat`` every half second (the agent's also carries the beats
its workers published in shared memory since the last one, ``protocol/beats.py``). An agent that loses the
coordinator (its connection closes, or a lease of silence) first takes part in the election of a
successor (agent/failover.py, once the coordinator has sent a ``Succession``): it keeps its
processes if a majority elects a new coordinator within a lease (it may be the one elected, and
then runs the coordinator itself, launcher/takeover.py). Otherwise it kills every process it
started, so that a partitioned host cannot keep acting as its ranks after they were given to a
spare host; the coordinator declares the host lost after the same lease. The agent then tries to
join again, as a new agent: the coordinator makes a rejoined host a spare host, never its old ranks.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from checkpointless.agent.agent import Agent, AgentConfig, ProcExit
from checkpointless.agent.failover import LOST, Early, Joined, elect, refuse_all
from checkpointless.agent.health import HealthConfig
from checkpointless.agent.health_nvml import NvmlWatch, open_nvml
from checkpointless.agent.health_watch import HealthWatch
from checkpointless.agent.join import job_outcome, join, read_secret
from checkpointless.config import ENV
from checkpointless.coordinator.rules.election import Ballot
from checkpointless.errors import ConfigError
from checkpointless.events import EventLog, get_logger, setup_logging
from checkpointless.launcher.control import ControlServer
from checkpointless.launcher.reaper import job_shm_dir
from checkpointless.launcher.runfiles import COORDINATOR_FILE
from checkpointless.launcher.takeover import Mandate
from checkpointless.protocol import (
    AgentHello,
    AgentWelcome,
    KillCmd,
    Message,
    PeerTable,
    ProcConnected,
    ProcExited,
    ProcStarted,
    ProcVerdict,
    ProtocolError,
    Shutdown,
    SpawnCmd,
    Succession,
    decode,
    encode,
)
from checkpointless.protocol.agent_link import local_node
from checkpointless.protocol.beats import beats_message
from checkpointless.protocol.control_client import ControlClient

__all__ = ["agent_env", "run_agent"]

log = get_logger()
_HEARTBEAT_S = 0.5
_LOST = LOST


def agent_env(w: AgentWelcome, host: str, secret_file: Path) -> dict[str, str]:
    """The environment of every process this agent starts (the job's, with this host's address)."""
    env = dict(os.environ)
    env.update(
        {
            ENV.CONTROL: w.control,
            ENV.SECRET_FILE: str(secret_file),
            ENV.RUN_DIR: w.run_dir,
            ENV.JOB_ID: w.job_id,
            ENV.HOST: host,
            ENV.SHM_KEY: w.shm_key,
            "PYTHONUNBUFFERED": "1",
            "GLOO_ENABLE_STORE_V2_API": "1",
        }
    )
    # this host's cores are shared by its own processes only
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, w.job.per_node))))
    return env


class _Session:
    """One connection to the coordinator, from hello to shutdown or fencing."""

    def __init__(self, client: ControlClient, inbox: queue.Queue[dict[str, Any]], w: AgentWelcome) -> None:
        self.client = client
        self.inbox = inbox
        self.w = w
        self.last_in = time.monotonic()
        self.broken = threading.Event()
        self.done = threading.Event()
        self.agent: Agent | None = None  # set once it exists: its workers' beats ride along
        self.succession: Succession | None = None
        self.why = ""
        # heartbeats on a thread of their own: starting a process can block this agent's loop
        # for seconds (the fork template's imports), longer than the coordinator's lease
        threading.Thread(target=self._beat, daemon=True, name="cl-agent-beat").start()

    def _beat(self) -> None:
        while not self.done.wait(_HEARTBEAT_S):
            # one frame per interval for the whole host: the workers' beats since the last one
            agent = self.agent
            beats = agent.read_beats(time.monotonic()) if agent is not None else []
            if not self.send(beats_message(beats, time.time())):
                self.broken.set()
                return

    def send(self, msg: Message) -> bool:
        try:
            self.client.send(encode(msg))
            return True
        except OSError:
            return False

    def run(self, agent: Agent, stop: list[int], failover: ControlServer, early: Early) -> str:
        """Serve until "shutdown" (the job ended), "lost" (the coordinator: its connection or a
        lease of silence), "fenced" (a broken coordinator) or "signal"."""
        while True:
            if stop:
                return "signal"
            now = time.monotonic()
            try:
                raw = self.inbox.get(timeout=0.05)
            except queue.Empty:
                raw = None
            if raw is not None:
                if raw.get("type") == _LOST:
                    log.warning("lost the coordinator: %s", raw.get("why"))
                    self.why = f"its connection ended: {raw.get('why')}"
                    return "lost"
                self.last_in = now
                try:
                    msg = decode(raw)
                except ProtocolError as e:
                    log.warning("bad message from the coordinator (%s); fencing", e)
                    return "fenced"
                if isinstance(msg, SpawnCmd):
                    address = agent.spawn(msg.worker_id, msg.role)
                    pid = agent.procs[msg.worker_id].handle.pid
                    self.send(ProcStarted(msg.worker_id, address, pid))
                elif isinstance(msg, KillCmd):
                    agent.kill(msg.worker_id, msg.why)
                elif isinstance(msg, ProcConnected):
                    agent.mark_connected(msg.worker_id)  # judged by heartbeats from now on
                elif isinstance(msg, PeerTable):
                    agent.on_table_chunk(msg)  # kept for this host's workers (protocol/tables.py)
                elif isinstance(msg, Shutdown):
                    return "shutdown"
                elif isinstance(msg, Succession) and msg.term >= self.w.term:
                    self.succession = msg
                    agent.succession = msg  # for the processes it starts from now on
            # a coordinator is serving: votes and reconnects here are peers that noticed its loss
            # first; they are kept a lease in case this agent stands next
            refuse_all(failover, early, self.w.job.lease, serving=self.w.term)
            for seen in agent.poll(now):
                if isinstance(seen, ProcExit):
                    rank = agent.finished.get(seen.worker_id, (-1, 0))[0]
                    self.send(
                        ProcExited(seen.worker_id, seen.code, seen.own_failure, seen.detail, seen.tail, rank)
                    )
                else:
                    self.send(ProcVerdict(seen.worker_id, seen.pid, seen.why))
            if self.broken.is_set():
                self.why = "a heartbeat could not be sent"
                return "lost"
            if now - self.last_in > self.w.job.lease:
                log.warning("no word from the coordinator for %.1f s (the lease)", self.w.job.lease)
                self.why = f"silent for {self.w.job.lease:.1f} s (lease)"
                return "lost"


def run_agent(
    coordinator: str,
    host: str,
    secret_file: Path,
    order: int = -1,
    connect_timeout: float = 60.0,
    rejoin: bool = True,
) -> int:
    """Serve one host until the job ends; 0 when the coordinator shut it down."""
    setup_logging(f"agent {host}")
    addr, _, port = coordinator.rpartition(":")
    if not addr or not port.isdigit():
        raise ConfigError(
            f"--coordinator {coordinator!r} is not HOST:PORT; e.g. --coordinator 10.0.0.1:29400"
        )
    secret = read_secret(secret_file, time.monotonic() + connect_timeout)
    # bound now so that its address can be in the succession: if this agent is ever elected,
    # the job's workers reconnect here (agent/failover.py)
    failover = ControlServer(host, 0, secret)
    failover.start()
    hello = AgentHello(
        host=host,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        node=local_node(),
        order=order,
        failover=f"{failover.address[0]}:{failover.address[1]}",
        health=True,  # agent/health_watch.py reports once it knows the job's checks
    )
    stop: list[int] = []
    old_term = signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    old_int = signal.signal(signal.SIGINT, lambda s, f: stop.append(s))
    # where to (re)join: the coordinator, then (after a failover is possible) its successors;
    # and before those the coordinator the run directory records, which after a failover is the
    # successor while --coordinator names the lost one (launcher/runfiles.py)
    targets = [coordinator]
    record = secret_file.parent / COORDINATOR_FILE
    served: str | None = None  # the job whose shared memory this host may still hold
    run_dir: Path | None = None
    try:
        while True:
            # Rejoining, a host may have been out of touch while the job ended (a spare host that
            # noticed a failover late, when the successor had already finished): the ending job
            # removes its secret, and its event log says how it ended.
            ended = None if run_dir is None else (lambda: not secret_file.exists())
            joined = join(targets, secret, hello, connect_timeout, record, ended, secret_file)
            if joined is None:
                status = job_outcome(run_dir) if run_dir is not None else None
                if status is not None:
                    log.info("the job ended (%s) while this host was out of touch: nothing to rejoin", status)
                    return 0 if status == "ok" else 1
                log.error(
                    "no coordinator welcomed this agent within --connect-timeout %.0f s (tried %s); "
                    "check that it runs and that --coordinator names it",
                    connect_timeout,
                    ", ".join(targets),
                )
                return 1
            client, inbox, welcome = joined
            served = welcome.job_id
            run_dir = Path(welcome.run_dir)
            record = run_dir / COORDINATOR_FILE
            log.info(
                "joined job %s as agent %d (lease %.1f s)",
                welcome.job_id,
                welcome.agent_id,
                welcome.job.lease,
            )
            outcome, code = _serve(client, inbox, welcome, host, secret, secret_file, stop, failover, targets)
            if outcome == "shutdown":
                return 0
            if outcome == "takeover":
                return code
            if outcome == "signal" or stop or not rejoin:
                # stopped (a signal while serving, or during an election: scancel signals the
                # coordinator and the agents at once) or told not to come back
                return 128 + stop[0] if stop else 1
            log.info("rejoining the coordinator as a new agent (a spare host)")
    finally:
        failover.stop()
        if served is not None:
            # a fenced agent keeps the job's shared memory only while it may serve the job again;
            # leaving for good (refused on rejoin, --no-rejoin, a signal) must not strand it
            shutil.rmtree(job_shm_dir(served), ignore_errors=True)
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def _serve(
    client: ControlClient,
    inbox: queue.Queue[dict[str, Any]],
    w: AgentWelcome,
    host: str,
    secret: bytes,
    secret_file: Path,
    stop: list[int],
    failover: ControlServer,
    targets: list[str],
) -> tuple[str, int]:
    """Serve the job's coordinators (through any failover) until the job ends, this host is
    fenced or this agent took over. ``targets`` is left naming where to rejoin after a fence:
    the last coordinator, then the successors this agent knew of (itself excluded)."""
    old = targets[0]
    session = _Session(client, inbox, w)  # heartbeats first: setting up (port probes) takes time
    env = agent_env(w, host, secret_file)
    os.environ[ENV.SHM_KEY] = w.shm_key  # job_shm_dir reads it
    cfg = AgentConfig.from_job(
        w.job, python=sys.executable, host=host, run_dir=Path(w.run_dir), nproc=w.job.per_node
    )
    events = EventLog(
        Path(w.run_dir) / f"agent-{w.agent_id}.jsonl", job=w.job_id, agent=w.agent_id, host=host
    )
    agent = Agent(cfg, env, events)
    session.agent = agent
    # the host's health checks (agent/health.py): the first run now, its report before the
    # coordinator may promote this host's spares, then every --health-interval
    nvml = NvmlWatch(open_nvml()) if w.job.health_builtins == "all" else None
    health = HealthWatch(HealthConfig.from_job(w.job, Path(w.run_dir), env), session.send, nvml)
    health.start()
    outcome = "fenced"
    outcome, code = "fenced", 1
    ballot = Ballot(voted=w.term)
    early: Early = []
    succession: Succession | None = None
    try:
        agent.start()
        while True:
            outcome = session.run(agent, stop, failover, early)
            session.done.set()
            succession = session.succession or succession
            if outcome != "lost" or succession is None:
                break
            session.client.close()
            result = elect(
                me=w.agent_id,
                host=host,
                succession=succession,
                ballot=ballot,
                server=failover,
                secret=secret,
                agent=agent,
                detected=time.monotonic(),
                why=session.why,
                old=old,
                stop=stop,
                early=early,
            )
            if isinstance(result, Joined):
                old = result.welcome.control
                agent.set_control(result.welcome.control)  # spares it starts reach the new one
                # the job's shm key is the same under every coordinator: keep the one this agent
                # opened at its join rather than the new welcome's sealed token
                welcome = dataclasses.replace(result.welcome, shm_key=w.shm_key)
                session = _Session(result.client, result.inbox, welcome)
                session.agent = agent  # its workers' beats go to the new coordinator
                session.succession = succession
                health.set_sender(session.send)  # and its health, the newest result at once
                client = result.client
                continue
            if result is not None:
                outcome, code = "takeover", _take_over(result, w, host, secret, secret_file, failover, agent)
            else:
                outcome = "fenced"
            break
    finally:
        health.stop()
        session.done.set()
        mine = f"{failover.address[0]}:{failover.address[1]}"
        later = [a for a in (succession.addresses if succession is not None else []) if a != mine]
        targets[:] = list(dict.fromkeys([old, *later]))
        if outcome in ("shutdown", "takeover"):
            agent.close(grace=5.0)  # the workers got their own shutdown and are finishing
            shutil.rmtree(job_shm_dir(w.job_id), ignore_errors=True)  # this host's shared memory
        else:
            # fenced (or stopped): nobody may act as these ranks any longer
            agent.signal_all(signal.SIGKILL)
            agent.close(grace=2.0)
            if stop:  # this agent will not rejoin: nothing of the job stays on this host
                shutil.rmtree(job_shm_dir(w.job_id), ignore_errors=True)
        session.client.close()
        events.close()
    return outcome, code


def _take_over(
    mandate: Mandate,
    w: AgentWelcome,
    host: str,
    secret: bytes,
    secret_file: Path,
    failover: ControlServer,
    agent: Agent,
) -> int:
    """This agent won the election: run the coordinator here until the job ends."""
    from checkpointless.launcher.identity import JobIdentity
    from checkpointless.launcher.takeover import TakeoverLauncher

    run_dir = Path(w.run_dir)
    cfg = dataclasses.replace(
        w.job,
        host=host,
        run_dir=run_dir,
        python=sys.executable,
        local_agent=False,
    )
    agent.set_control(f"{failover.address[0]}:{failover.address[1]}")
    job = JobIdentity(w.job_id, secret, secret_file, run_dir, w.shm_key)
    return TakeoverLauncher(cfg, job, failover, agent, mandate).run()
