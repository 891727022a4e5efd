"""The shell of a coordinator that took over after a failover, inside the winning agent.

It is the :class:`~checkpointless.launcher.launcher.Launcher` loop with a different start: the
run directory, the secret and the event log already exist, the control server is the agent's
failover server (bound when the agent started, so its address was in the succession), the
agent's own :class:`~checkpointless.agent.Agent` is the local agent, and the voters' connections
are the remote agents. Before the loop it gathers the workers' reconnects (bounded), rebuilds the
state (coordinator/rules/rebuild.py) and opens the first round (coordinator/takeover.py).
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointless.agent.agent import Agent, ProcExit
from checkpointless.coordinator import Coordinator
from checkpointless.coordinator.rules.rebuild import Finished, ProcReport, WorkerReport, rebuild
from checkpointless.coordinator.takeover import TakeoverHost, resume
from checkpointless.events import EventLog, get_logger, setup_logging
from checkpointless.launcher.agents import _beat_agents
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.launcher import Launcher
from checkpointless.launcher.model import LaunchConfig, checkpoint_root
from checkpointless.launcher.runfiles import record_coordinator
from checkpointless.observe.hooks import start_observers
from checkpointless.protocol import Hello, ProcExited, ProtocolError, Vote, decode, encode

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


class TakeoverLauncher(Launcher):
    def __init__(
        self,
        cfg: LaunchConfig,
        job_id: str,
        secret: bytes,
        secret_file: Path,
        shm_key: str,
        server: ControlServer,
        agent: Agent,
        mandate: Mandate,
    ) -> None:
        # not Launcher.__init__: the run directory, secret and shared-memory key exist already
        self.cfg = cfg
        self.job_id = job_id
        self.secret = secret
        assert cfg.run_dir is not None
        self.run_dir = cfg.run_dir
        self._created_run_dir = False
        self.secret_file = secret_file
        self.shm_key = shm_key
        self.events = EventLog(self.run_dir / "events.jsonl", job=job_id)
        # agents that join from now on get ids no member ever had (a fenced member may rejoin)
        self._init_loop(
            term=mandate.term,
            local_host=mandate.agent_id,
            next_host=1 + max([mandate.agent_id, *mandate.members]),
        )
        self.agent = agent
        self.server = server
        self.mandate = mandate
        self._resumed = False
        self._settled: float | None = None  # when every reported process had reconnected
        self._later: list[tuple[Connection, dict[str, Any]]] = []  # workers' messages in the gather
        self._left: list[Finished] = []  # workers that left after their loop, reported in the gather

    def run(self) -> int:
        setup_logging("coordinator")
        m = self.mandate
        self.observers = start_observers(self.run_dir, self.events, self.cfg.host, None, None)
        threading.Thread(
            target=_beat_agents, args=(self._agents, self._beat_stop), daemon=True, name="cl-agent-beat"
        ).start()
        self.store_desc = self._make_rendezvous()
        old_int = signal.signal(signal.SIGINT, self._on_signal)
        old_term = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            coord = self.coordinator = Coordinator(
                self.cfg,
                self.job_id,
                self.store_desc,
                str(checkpoint_root(self.cfg, self.run_dir, self.job_id)),
            )
            for conn, vote in m.voters.items():
                self._agents[vote.agent_id] = conn
                self._agent_of[conn] = vote.agent_id
                conn.send(encode(self._welcome(vote.agent_id)))
            procs, workers = self._gather()
            hosts = [TakeoverHost(m.agent_id, m.host, False)]
            hosts += [TakeoverHost(v.agent_id, v.host, True) for v in m.voters.values()]
            now, wall = time.monotonic(), time.time()
            rebuilt = rebuild(procs, workers, self.cfg.nproc, self._finished())
            log.info(
                "rebuild from %d processes (%s), %d reconnects (%s) and %d ranks finished (%s)",
                len(procs), ", ".join(f"{p.worker_id}@{p.host}:{p.role}" for p in procs),
                len(workers), ", ".join(f"{w.worker_id}:r{w.rank}g{w.generation}" for w in workers),
                len(rebuilt.finished), ", ".join(str(r) for r in rebuilt.finished),
            )  # fmt: skip
            resume(
                coord, hosts, procs, workers, rebuilt, f"coordinator lost ({m.why})", m.detected, wall, now
            )
            # where agents that start from now on find the job (the record names the lost one)
            record_coordinator(self.run_dir, self.control_address)
            # the next succession: this agent and its voters, each at its failover address
            self._failover = {m.agent_id: self.control_address}
            self._failover.update({v.agent_id: v.failover for v in m.voters.values() if v.failover})
            elect_s, rebuild_s = m.elected - m.detected, now - m.elected
            self.events.emit(
                "coordinator_failover",
                old=m.old,
                new=self.control_address,
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
            self._announce()
            self._execute()
            for conn, raw in self._later:
                self._receive(conn, raw)
            self._loop()
        except Exception as e:
            if self.coordinator is not None:
                self.coordinator.fail(f"coordinator error after takeover: {type(e).__name__}: {e}")
                self._execute()
            raise
        finally:
            self._shutdown()
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
        return self.exit_code

    def _gather(self) -> tuple[list[ProcReport], list[WorkerReport]]:
        """Processes the agents reported, and the workers' hellos: every member agent that has
        not voted yet (it found the loss a little later) and every reported process gets until
        the deadline (a lease, at least 2 s), members only half a second once every
        reported process is back; nobody vouches for the rest."""
        m = self.mandate
        assert self.agent is not None
        procs: dict[int, ProcReport] = {}
        for wid, p in self.agent.procs.items():
            store = f"{m.host}:{p.store_port}" if p.store_port else ""
            procs[wid] = ProcReport(wid, m.agent_id, p.role, p.handle.pid, store, p.connected)
        for vote in m.voters.values():
            procs.update(_reported(vote))
        workers: dict[int, WorkerReport] = {}
        self._orphans: dict[int, tuple[Connection, Hello]] = {}  # hellos before their agent's vote
        backlog = list(m.pending)
        # a lease: a worker on a busy host may take a while to notice and reconnect, and it gives
        # up only after two leases; once every reported process is back the wait ends at once
        deadline = time.monotonic() + max(2.0, self.cfg.lease)
        while time.monotonic() < deadline:
            if {wid for wid, p in procs.items() if p.connected} <= set(workers):
                if set(m.members) <= {m.agent_id, *self._agents}:
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
            self._gathered(conn, raw, procs, workers)
        for conn, raw in backlog:  # after the deadline: the loop's ordinary path handles them
            self.server.inbox.put((conn, raw))
        for conn, _ in self._orphans.values():
            conn.hang_up()  # no voting agent reported this process
        return list(procs.values()), list(workers.values())

    def _finished(self) -> list[Finished]:
        """Workers that left after finishing their loop, as this host's agent and the voters saw
        them (the lost coordinator had acknowledged their Done, but not yet ended the job)."""
        m = self.mandate
        assert self.agent is not None
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
        assert self.agent is not None
        for seen in self.agent.poll(time.monotonic()):
            if isinstance(seen, ProcExit):  # one fewer to wait for
                procs.pop(seen.worker_id, None)

    def _gathered(
        self,
        conn: Connection,
        raw: dict[str, Any],
        procs: dict[int, ProcReport],
        workers: dict[int, WorkerReport],
    ) -> None:
        if raw.get("type") == "_closed":
            if conn.worker_id is not None and self._conns.get(conn.worker_id) is conn:
                del self._conns[conn.worker_id]
                workers.pop(conn.worker_id, None)
            return
        try:
            msg = decode(raw)
        except ProtocolError:
            conn.hang_up()
            return
        said_hello = conn.worker_id is not None or any(c is conn for c, _ in self._orphans.values())
        if conn in self._agent_of or said_hello:
            if isinstance(msg, ProcExited):
                procs.pop(msg.worker_id, None)
                if msg.finished_rank >= 0 and conn in self._agent_of:  # left after its loop
                    self._left.append(
                        Finished(msg.worker_id, self._agent_of[conn], msg.finished_rank, msg.code)
                    )
            elif conn not in self._agent_of:
                self._later.append((conn, raw))  # a worker's report: for the first round
            return
        m = self.mandate
        if isinstance(msg, Vote) and msg.term == self.term and msg.agent_id in m.members:
            if msg.agent_id == m.agent_id or msg.agent_id in self._agents:
                conn.hang_up()
                return
            # a member that found the loss a little after the majority: it joins, with its processes
            m.voters[conn] = msg
            self._agents[msg.agent_id] = conn
            self._agent_of[conn] = msg.agent_id
            conn.send(encode(self._welcome(msg.agent_id)))
            for wid, p in _reported(msg).items():
                procs[wid] = p
                if wid in self._orphans:
                    c, h = self._orphans.pop(wid)
                    self._take_hello(c, h, workers)
            return
        if isinstance(msg, Hello) and 0 < msg.term <= self.term and conn.worker_id is None:
            if msg.worker_id in workers or msg.worker_id in self._orphans:
                conn.hang_up()
            elif msg.worker_id not in procs:
                self._orphans[msg.worker_id] = (conn, msg)  # its agent's vote may be on its way
            else:
                self._take_hello(conn, msg, workers)
            return
        conn.hang_up()  # another term's vote or reconnect, or a frame before hello

    def _take_hello(self, conn: Connection, msg: Hello, workers: dict[int, WorkerReport]) -> None:
        conn.worker_id = msg.worker_id
        self._conns[msg.worker_id] = conn
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

    def _execute(self) -> None:
        super()._execute()
        coord = self.coordinator
        if coord is not None and not self._resumed and coord.recoveries:
            # the first recovery after the takeover: every rank has committed a step again
            self._resumed = True
            self.events.emit(
                "coordinator_resumed",
                term=self.term,
                seconds=round(time.monotonic() - self.mandate.detected, 4),
                downtime_s=coord.recoveries[0].get("downtime_s"),
            )
