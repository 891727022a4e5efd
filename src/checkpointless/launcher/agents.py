"""The coordinator's remote agents, and who succeeds the coordinator.

:class:`AgentHosts` owns one coordinator term's registry of remote agents: their connections,
the ids it gives them, their failover addresses and node names, the lease beats it sends them,
the welcome each gets, the membership last announced, stepping down without a majority, and
releasing them at the end. The decision loop (``loop.py``) hands it every agent's message and
sends through it whatever the coordinator decided for a remote host; the loop also announces the
succession this registry computes, because the announcement goes to the workers too.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from pathlib import Path

from checkpointless.coordinator import Coordinator
from checkpointless.coordinator.rules.election import HostSeen, keeps_majority, membership
from checkpointless.events import EventLog, get_logger
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.identity import JobIdentity
from checkpointless.launcher.model import LaunchConfig
from checkpointless.launcher.outcome import Outcome
from checkpointless.protocol import (
    AgentHeartbeat,
    AgentHello,
    AgentRefused,
    AgentWelcome,
    HealthReport,
    Message,
    ProcExited,
    ProcStarted,
    ProcVerdict,
    ProtocolError,
    Shutdown,
    Succession,
    encode,
)
from checkpointless.protocol.agent_link import SHM_KEY_LABEL
from checkpointless.protocol.beats import beats_of
from checkpointless.wire import seal_value

__all__ = ["AgentHosts", "claimed_host"]

log = get_logger()
_BEAT_S = 0.5  # the coordinator's side of the lease


def claimed_host(live: list[tuple[int, str, str | None, str | None]], hello: AgentHello) -> int | None:
    """The live host whose address and node ``hello`` claims, if another agent serves it: None
    when they are free or the hello comes from that host's own agent again.

    ``live`` is each live host's id, address, failover address (None where it has none: the
    coordinator's own host) and node name (None where unknown: hosts a successor inherited). An
    agent's failover address is its own listening socket, bound once per agent process, so the
    same one is the same agent rejoining after its host was fenced (its old host not yet declared
    lost); any other is a second agent on a host that already has one, whose processes would
    share that host's ports and name. The node name keeps apart hosts that share an address on
    purpose: several Slurm nodes on one machine (one slurmd each). A host whose node is unknown
    is never claimed: refusing a real host would cost the job a spare, a missed duplicate only
    a warning's worth."""
    for host, address, failover, node in live:
        if address != hello.host or node is None or node != hello.node:
            continue
        if not (failover and failover == hello.failover):
            return host
    return None


class AgentHosts:
    """The remote agents of one coordinator term, and the succession they and the workers learn.

    The embedded agent (``launcher.py``'s host 0, or the agent a takeover runs in) is not one of
    them: the decision loop drives it directly.
    """

    def __init__(
        self,
        cfg: LaunchConfig,
        job: JobIdentity,
        server: ControlServer,
        coordinator: Coordinator,
        events: EventLog,
        outcome: Outcome,
        *,
        term: int,
        next_host: int,
        nodes: dict[int, str],
    ) -> None:
        self.cfg = cfg
        self.job = job
        self.server = server
        self.coordinator = coordinator
        self.events = events
        self.outcome = outcome
        self.term = term  # this coordinator's term (docs/architecture.md, coordinator failover)
        self._conns: dict[int, Connection] = {}  # agent (host) id -> a remote agent's connection
        self._host_of: dict[Connection, int] = {}
        self._next_host = next_host
        self._failover: dict[int, str] = {}  # agent id -> the address it serves the control channel on
        # each agent's node name, to refuse a second agent for a live host (claimed_host); the
        # hosts a successor inherits are unknown, and never claimed
        self._node = dict(nodes)
        self._announced: list[int] = []  # the membership last sent to everyone
        self._beat_stop = threading.Event()
        self._beats: threading.Thread | None = None

    # -- the lease ----------------------------------------------------------------------------
    def start_beats(self) -> None:
        self._beats = threading.Thread(target=self._beat, daemon=True, name="cl-agent-beat")
        self._beats.start()

    def stop_beats(self) -> None:
        self._beat_stop.set()

    def _beat(self) -> None:
        """The coordinator's side of the lease, on a thread of its own: a decision loop busy for a
        few seconds (starting a process, a slow disk) must not make every agent fence its host."""
        while not self._beat_stop.wait(_BEAT_S):
            for conn in list(self._conns.values()):
                conn.send(encode(AgentHeartbeat(time.time())))

    # -- the registry --------------------------------------------------------------------------
    def is_agent(self, conn: Connection) -> bool:
        return conn in self._host_of

    def host_of(self, conn: Connection) -> int | None:
        return self._host_of.get(conn)

    def has(self, host: int) -> bool:
        return host in self._conns

    def ids(self) -> set[int]:
        return set(self._conns)

    def connections(self) -> list[Connection]:
        return list(self._conns.values())

    def send(self, host: int, msg: Message) -> bool:
        """Send ``msg`` to ``host``'s agent; False if ``host`` has no remote agent here."""
        conn = self._conns.get(host)
        if conn is None:
            return False
        conn.send(encode(msg))
        return True

    def adopt(self, host: int, conn: Connection) -> None:
        """Take an agent whose id it already has (a takeover's voter) and welcome it."""
        self._conns[host] = conn
        self._host_of[conn] = host
        conn.send(encode(self.welcome(host)))

    def drop(self, conn: Connection) -> int | None:
        """An agent's connection closed: forget it; its host id, or None if it was no agent's."""
        host = self._host_of.pop(conn, None)
        if host is not None:
            self._conns.pop(host, None)
        return host

    def cut_off_fenced(self) -> bool:
        """Hang up on the agents of hosts the coordinator fenced (each rejoins as a new agent);
        True if there were any: the membership a majority is counted against has shrunk."""
        changed = False
        for host, conn in list(self._conns.items()):
            if not self.coordinator.host_alive(host):
                del self._conns[host]
                conn.hang_up()
                changed = True
        return changed

    def set_failover(self, addresses: dict[int, str]) -> None:
        """The failover address of each host that may succeed this coordinator (a takeover's)."""
        self._failover = dict(addresses)

    # -- the succession ------------------------------------------------------------------------
    def _watching(self) -> bool:
        return bool(self._failover) and self.coordinator.started

    def membership_changed(self, now: float) -> bool:
        """A lost host aged out of the membership last announced (a new succession is due)."""
        return self._watching() and self._members(now) != self._announced

    def lost_majority(self, now: float) -> bool:
        """A coordinator cut off from most of its hosts steps down (without ending the job): the
        majority may be electing a successor, and two coordinators must never act at once. Its
        own hosts' agents then lose it and fence themselves unless they join the majority's."""
        if not self._watching():
            return False
        if keeps_majority(self._seen(), now, self.cfg.lease):
            return False
        members = membership(self._seen(), now, self.cfg.lease)
        heard = [
            h for h in self.coordinator.hosts.values() if not h.lost and now - h.last_seen <= self.cfg.lease
        ]
        why = (
            f"heard from only {len(heard)} of {len(members)} hosts within the lease "
            f"({self.cfg.lease:.1f} s): no majority, stepping down so that the majority's successor "
            "is the only coordinator"
        )
        log.error("%s", why)
        self.events.emit("coordinator_step_down", term=self.term, why=why)
        self.outcome.stepped_down = True
        self.outcome.stop("stepped down", 75)
        return True

    def _seen(self) -> list[HostSeen]:
        return [HostSeen(h.host, h.lost, h.remote, h.last_seen) for h in self.coordinator.hosts.values()]

    def _members(self, now: float) -> list[int]:
        """The membership a majority is counted against (coordinator/rules/election.py); agents are
        told the same, so that a side of a partition that heard of its peers' loss one by one
        cannot count itself a majority either."""
        return membership(self._seen(), now, self.cfg.lease)

    def succession(self, now: float, *, record: bool) -> Succession | None:
        """Who may take over, as agents and workers are told (None: nobody can); ``record``: it
        goes to everyone, so its membership is the one announced."""
        live = sorted(h.host for h in self.coordinator.hosts.values() if not h.lost)
        successors = [h for h in live if self._failover.get(h)]
        if not successors:
            return None
        members = self._members(now)
        if record:
            self._announced = members
        return Succession(
            term=self.term,
            members=members,
            successors=successors,
            addresses=[self._failover[h] for h in successors],
            lease=self.cfg.lease,
        )

    # -- an agent's messages -------------------------------------------------------------------
    def on_message(self, conn: Connection, msg: Message, now: float) -> bool:
        """A remote agent's hello or report (see agent/remote.py); True when an agent joined (a
        new succession is due)."""
        coord = self.coordinator
        if isinstance(msg, AgentHello):
            return self._hello(conn, msg, now)
        host = self._host_of[conn]
        if not coord.host_alive(host):
            conn.hang_up()  # a fenced host: its reports are about ranks that moved on
            return False
        coord.on_agent_seen(host, now)
        if isinstance(msg, ProcStarted):
            coord.on_started(msg.worker_id, msg.store_address)
        elif isinstance(msg, ProcExited):
            coord.on_exit(msg.worker_id, msg.code, msg.own_failure, msg.detail, msg.tail, now, time.time())
        elif isinstance(msg, ProcVerdict):
            coord.on_verdict(msg.worker_id, f"(pid {msg.pid}) {msg.why}", now)
        elif isinstance(msg, HealthReport):
            coord.on_host_health(host, msg, now)
        elif isinstance(msg, AgentHeartbeat):
            try:
                coord.on_beats(host, beats_of(msg), now)
            except ProtocolError as e:
                log.warning("closing agent %d's connection: %s", host, e)
                conn.hang_up()
        return False

    def _hello(self, conn: Connection, msg: AgentHello, now: float) -> bool:
        coord = self.coordinator
        if conn in self._host_of or conn.worker_id is not None or coord.stopping is not None:
            conn.hang_up()
            return False
        live = [
            (h.host, h.address, self._failover.get(h.host), self._node.get(h.host))
            for h in coord.hosts.values()
            if not h.lost
        ]
        taken = claimed_host(live, msg)
        if taken is not None:
            why = (
                f"host {msg.host} is served by agent {taken} already (live); this agent "
                f"(pid {msg.pid} on {msg.hostname or '?'}) is a second one for the same host: "
                "stop it, or give it this host's own address with --host"
            )
            log.warning("refused an agent from %s (%s): %s", msg.host, msg.hostname or "?", why)
            conn.send(encode(AgentRefused(why)))
            conn.hang_up()
            return False
        host = self._next_host
        self._next_host += 1
        self._host_of[conn] = host
        # the welcome before the registry: the lease thread (_beat) heartbeats every registered
        # connection, and an agent whose first message is a heartbeat, not its welcome, takes it
        # for a refusal and gives that coordinator up ("refused this agent (None)", seen in CI)
        conn.send(encode(self.welcome(host)))
        self._conns[host] = conn
        coord.add_host(host, msg.host, True, now, msg.order)
        if msg.health:
            coord.health.expect(host)  # its spares wait for its first health report
        if msg.failover:
            self._failover[host] = msg.failover
        self._node[host] = msg.node
        log.info("agent %d joined from %s (%s)", host, msg.host, msg.hostname or "?")
        return True

    def welcome(self, host: int) -> AgentWelcome:
        c = self.cfg
        return AgentWelcome(
            agent_id=host,
            job_id=self.job.job_id,
            control=f"{self.server.address[0]}:{self.server.address[1]}",
            run_dir=str(self.job.run_dir.resolve()),
            shm_key=seal_value(self.server.secret, SHM_KEY_LABEL, self.job.shm_key.encode()),
            job=dataclasses.replace(c, script=str(Path(c.script).resolve())),
            term=self.term,
        )

    # -- the end -------------------------------------------------------------------------------
    def release(self, grace: float) -> None:
        """Tell every remote agent the job is over and wait (bounded) until they hang up, so
        that their processes are gone before the job's shared memory is removed."""
        for conn in self._conns.values():
            conn.send(encode(Shutdown(code=self.outcome.code, reason=self.outcome.stopping)))
        deadline = time.monotonic() + grace
        while self._conns and time.monotonic() < deadline:
            try:
                conn, raw = self.server.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if raw.get("type") == "_closed" and conn in self._host_of:
                self._conns.pop(self._host_of.pop(conn), None)
