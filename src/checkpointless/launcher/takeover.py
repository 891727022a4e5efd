"""The shell of a coordinator that took over after a failover, inside the winning agent.

It runs the same :class:`~checkpointless.launcher.shell.CoordinatorShell` as a new job's launcher,
with a different start: the run directory, the secret and the event log already exist, the
control server is the agent's failover server (bound when the agent started, so its address was
in the succession), the agent's own :class:`~checkpointless.agent.Agent` is the embedded agent,
and the voters' connections are the remote agents. Before the loop it gathers the workers' reconnects (bounded), rebuilds the
state (coordinator/rules/rebuild.py) and opens the first round (coordinator/takeover.py).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

from checkpointless.agent.agent import Agent, ProcExit
from checkpointless.coordinator import Coordinator
from checkpointless.coordinator.rules.rebuild import Finished, ProcReport, WorkerReport, rebuild
from checkpointless.coordinator.takeover import TakeoverHost, resume
from checkpointless.events import EventLog, get_logger, setup_logging
from checkpointless.launcher.agents import AgentHosts
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.identity import JobIdentity
from checkpointless.launcher.loop import DecisionLoop
from checkpointless.launcher.model import LaunchConfig
from checkpointless.launcher.runfiles import record_coordinator
from checkpointless.launcher.shell import CoordinatorShell, NoObservers
from checkpointless.launcher.store import JobStore
from checkpointless.protocol import Hello, ProcExited, ProtocolError, Vote, decode

__all__ = ["Mandate", "TakeoverLauncher"]

log = get_logger()
_MEMBER_GRACE_S = 0.5  # how long a takeover waits for a member's late vote once all else is in


@dataclass
class Mandate:
    """What an agent won in its election: the term, its voters, and what arrived meanwhile."""

    term: int
    agent_id: int
    host: str  # this agent's address
    old: str  # the lost coordinator's control address
    why: str  # how it was lost
    detected: float  # monotonic time this agent found it lost
    elected: float  # monotonic time the majority was reached
    members: list[int]
    voters: dict[Connection, Vote] = field(default_factory=dict)
    pending: list[tuple[Connection, dict[str, Any]]] = field(default_factory=list)


def _reported(vote: Vote) -> dict[int, ProcReport]:
    """The processes a vote lists (parallel lists on the wire)."""
    connected = vote.connected or [True] * len(vote.worker_ids)
    rows = zip(vote.worker_ids, vote.roles, vote.pids, vote.stores, connected, strict=False)
    return {wid: ProcReport(wid, vote.agent_id, role, pid, store, c) for wid, role, pid, store, c in rows}


class TakeoverLauncher:
    """The coordinator an agent runs after it won the election, until the job ends."""

    def __init__(
        self, cfg: LaunchConfig, job: JobIdentity, server: ControlServer, agent: Agent, mandate: Mandate
    ) -> None:
        # not a new job's Launcher: the run directory, secret and shared-memory key exist already
        assert cfg.run_dir is not None and cfg.run_dir == job.run_dir
        self.cfg = cfg
        self.mandate = mandate
        events = EventLog(job.run_dir / "events.jsonl", job=job.job_id)
        self.shell = CoordinatorShell(cfg, job, events, server=server, agent=agent)
        self.agent = agent
        self.server = server
        self._resumed = False
        self._settled: float | None = None  # when every reported process had reconnected
        self._later: list[tuple[Connection, dict[str, Any]]] = []  # workers' messages in the gather
        self._left: list[Finished] = []  # workers that left after their loop, reported in the gather
        self._orphans: dict[int, tuple[Connection, Hello]] = {}  # hellos before their agent's vote

    def run(self) -> int:
        setup_logging("coordinator")
        m, shell = self.mandate, self.shell
        shell.observers = NoObservers()  # no metrics or progress after a takeover
        shell.store = JobStore(self.cfg)
        with shell.signals_handled():
            try:
                # agents that join from now on get ids no member ever had (a fenced member may rejoin)
                loop = shell.start_term(
                    term=m.term,
                    local_host=m.agent_id,
                    next_host=1 + max([m.agent_id, *m.members]),
                    on_executed=self._after_execute,
                )
                self._take_over(loop, loop.coordinator, loop.hosts)
                loop.run()
            except Exception as e:
                shell.fail(f"coordinator error after takeover: {type(e).__name__}: {e}")
                raise
            finally:
                shell.shutdown()
        return shell.outcome.code

    def _take_over(self, loop: DecisionLoop, coord: Coordinator, hosts: AgentHosts) -> None:
        """The voters become this coordinator's agents, the workers reconnect, the state is
        rebuilt from what they all reported, and the first round opens."""
        m, shell = self.mandate, self.shell
        for conn, vote in m.voters.items():
            hosts.adopt(vote.agent_id, conn)
        procs, workers = self._gather(loop, hosts)
        takeover_hosts = [TakeoverHost(m.agent_id, m.host, False)]
        takeover_hosts += [TakeoverHost(v.agent_id, v.host, True) for v in m.voters.values()]
        now, wall = time.monotonic(), time.time()
        rebuilt = rebuild(procs, workers, self.cfg.nproc, self._finished())
        log.info(
            "rebuild from %d processes (%s), %d reconnects (%s) and %d ranks finished (%s)",
            len(procs), ", ".join(f"{p.worker_id}@{p.host}:{p.role}" for p in procs),
            len(workers), ", ".join(f"{w.worker_id}:r{w.rank}g{w.generation}" for w in workers),
            len(rebuilt.finished), ", ".join(str(r) for r in rebuilt.finished),
        )  # fmt: skip
        resume(
            coord,
            takeover_hosts,
            procs,
            workers,
            rebuilt,
            f"coordinator lost ({m.why})",
            m.detected,
            wall,
            now,
        )
        # where agents that start from now on find the job (the record names the lost one)
        record_coordinator(shell.job.run_dir, shell.control_address)
        # the next succession: this agent and its voters, each at its failover address
        failover = {m.agent_id: shell.control_address}
        failover.update({v.agent_id: v.failover for v in m.voters.values() if v.failover})
        hosts.set_failover(failover)
        elect_s, rebuild_s = m.elected - m.detected, now - m.elected
        shell.events.emit(
            "coordinator_failover",
            old=m.old,
            new=shell.control_address,
            agent=m.agent_id,
            term=m.term,
            voters=sorted([m.agent_id, *(v.agent_id for v in m.voters.values())]),
            members=m.members,
            elect_s=round(elect_s, 4),
            rebuild_s=round(rebuild_s, 4),
            ranks=len(rebuilt.ranks),
            missing=rebuilt.missing,
            killed=rebuilt.kill,
            generation=rebuilt.generation,
        )
        log.warning(
            "took over as coordinator (term %d) %.2f s after losing %s: elected in %.2f s, rebuilt "
            "in %.2f s; %d ranks kept, missing %s, generation %d next",
            m.term, now - m.detected, m.old, elect_s, rebuild_s, len(rebuilt.ranks), rebuilt.missing,
            rebuilt.generation,
        )  # fmt: skip
        loop.announce()
        loop.execute()
        for conn, raw in self._later:
            loop.receive(conn, raw)

    def _gather(self, loop: DecisionLoop, hosts: AgentHosts) -> tuple[list[ProcReport], list[WorkerReport]]:
        """Processes the agents reported, and the workers' hellos: every member agent that has
        not voted yet (it found the loss a little later) and every reported process gets until
        the deadline (a lease, at least 2 s), members only half a second once every
        reported process is back; nobody vouches for the rest."""
        m = self.mandate
        procs: dict[int, ProcReport] = {}
        for wid, p in self.agent.procs.items():
            store = f"{m.host}:{p.store_port}" if p.store_port else ""
            procs[wid] = ProcReport(wid, m.agent_id, p.role, p.handle.pid, store, p.connected)
        for vote in m.voters.values():
            procs.update(_reported(vote))
        workers: dict[int, WorkerReport] = {}
        backlog = list(m.pending)
        # a lease: a worker on a busy host may take a while to notice and reconnect, and it gives
        # up only after two leases; once every reported process is back the wait ends at once
        deadline = time.monotonic() + max(2.0, self.cfg.lease)
        while time.monotonic() < deadline:
            if {wid for wid, p in procs.items() if p.connected} <= set(workers):
                if set(m.members) <= {m.agent_id, *hosts.ids()}:
                    break
                # everyone reported has reconnected; a member that has not voted yet gets a
                # short grace, not the whole deadline: it is most likely the lost side
                deadline = min(deadline, self._settled_at(_MEMBER_GRACE_S))
            if backlog:
                conn, raw = backlog.pop(0)
            else:
                try:
                    conn, raw = self.server.inbox.get(timeout=0.02)
                except queue.Empty:
                    self._poll_local(procs)
                    continue
            self._gathered(loop, hosts, conn, raw, procs, workers)
        for conn, raw in backlog:  # after the deadline: the loop's ordinary path handles them
            self.server.inbox.put((conn, raw))
        for conn, _ in self._orphans.values():
            conn.hang_up()  # no voting agent reported this process
        return list(procs.values()), list(workers.values())

    def _finished(self) -> list[Finished]:
        """Workers that left after finishing their loop, as this host's agent and the voters saw
        them (the lost coordinator had acknowledged their Done, but not yet ended the job)."""
        m = self.mandate
        out = [Finished(wid, m.agent_id, rank, code) for wid, (rank, code) in self.agent.finished.items()]
        for v in m.voters.values():
            rows = zip(v.finished_workers, v.finished_ranks, v.finished_codes, strict=False)
            out += [Finished(wid, v.agent_id, rank, code) for wid, rank, code in rows]
        return out + self._left

    def _settled_at(self, grace: float) -> float:
        if self._settled is None:
            self._settled = time.monotonic()
        return self._settled + grace

    def _poll_local(self, procs: dict[int, ProcReport]) -> None:
        for seen in self.agent.poll(time.monotonic()):
            if isinstance(seen, ProcExit):  # one fewer to wait for
                procs.pop(seen.worker_id, None)

    def _gathered(
        self,
        loop: DecisionLoop,
        hosts: AgentHosts,
        conn: Connection,
        raw: dict[str, Any],
        procs: dict[int, ProcReport],
        workers: dict[int, WorkerReport],
    ) -> None:
        if raw.get("type") == "_closed":
            if loop.detach_worker(conn):
                assert conn.worker_id is not None
                workers.pop(conn.worker_id, None)
            return
        try:
            msg = decode(raw)
        except ProtocolError:
            conn.hang_up()
            return
        said_hello = conn.worker_id is not None or any(c is conn for c, _ in self._orphans.values())
        agent_id = hosts.host_of(conn)
        if agent_id is not None or said_hello:
            if isinstance(msg, ProcExited):
                procs.pop(msg.worker_id, None)
                if msg.finished_rank >= 0 and agent_id is not None:  # left after its loop
                    self._left.append(Finished(msg.worker_id, agent_id, msg.finished_rank, msg.code))
            elif agent_id is None:
                self._later.append((conn, raw))  # a worker's report: for the first round
            return
        m = self.mandate
        if isinstance(msg, Vote) and msg.term == m.term and msg.agent_id in m.members:
            if msg.agent_id == m.agent_id or hosts.has(msg.agent_id):
                conn.hang_up()
                return
            # a member that found the loss a little after the majority: it joins, with its processes
            m.voters[conn] = msg
            hosts.adopt(msg.agent_id, conn)
            for wid, p in _reported(msg).items():
                procs[wid] = p
                if wid in self._orphans:
                    c, h = self._orphans.pop(wid)
                    self._take_hello(loop, c, h, workers)
            return
        if isinstance(msg, Hello) and 0 < msg.term <= m.term and conn.worker_id is None:
            if msg.worker_id in workers or msg.worker_id in self._orphans:
                conn.hang_up()
            elif msg.worker_id not in procs:
                self._orphans[msg.worker_id] = (conn, msg)  # its agent's vote may be on its way
            else:
                self._take_hello(loop, conn, msg, workers)
            return
        conn.hang_up()  # another term's vote or reconnect, or a frame before hello

    def _take_hello(
        self, loop: DecisionLoop, conn: Connection, msg: Hello, workers: dict[int, WorkerReport]
    ) -> None:
        loop.attach_worker(msg.worker_id, conn)
        workers[msg.worker_id] = WorkerReport(
            msg.worker_id,
            msg.rank if msg.rank >= 0 else None,
            msg.generation,
            msg.step,
            ready=msg.ready,
            aborted=msg.aborted,
            step=msg.step,
            done=msg.done,
        )

    def _after_execute(self) -> None:
        coord = self.shell.coordinator
        if coord is not None and not self._resumed and coord.recoveries:
            # the first recovery after the takeover: every rank has committed a step again
            self._resumed = True
            self.shell.events.emit(
                "coordinator_resumed",
                term=self.mandate.term,
                seconds=round(time.monotonic() - self.mandate.detected, 4),
                downtime_s=coord.recoveries[0].get("downtime_s"),
            )
