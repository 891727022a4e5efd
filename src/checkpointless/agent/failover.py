"""An agent's side of coordinator failover: the election after the coordinator is lost.

The rules are pure (coordinator/rules/election.py); this module does the I/O. Term by term: the
term's candidate counts votes on its failover server (bound when the agent started, named in the
succession) and wins with a strict majority of the membership; every other agent connects to the
candidate, sends its :class:`~checkpointless.protocol.Vote` (its processes, for the rebuild) and
waits for the winner's welcome. A term that gets nowhere within its window is given up for the
next. Everything ends by a ``time.monotonic()`` deadline, one lease after the loss, after which
the caller fences its host. See docs/architecture.md, "Coordinator failover".
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

from checkpointless.agent.agent import Agent
from checkpointless.coordinator.rules.election import Ballot, candidate_for, has_quorum
from checkpointless.events import get_logger
from checkpointless.launcher.control import Connection, ControlServer
from checkpointless.launcher.takeover import Mandate
from checkpointless.protocol import AgentWelcome, Hello, ProtocolError, Succession, Vote, decode, encode
from checkpointless.protocol.control_client import ControlClient

__all__ = ["LOST", "Early", "Joined", "elect", "refuse_all"]

log = get_logger()
LOST = "_lost"  # what a ControlClient's loss is queued as, next to the decoded messages


@dataclass
class Joined:
    """This agent voted for the winner and was welcomed: serve it as before."""

    client: ControlClient
    inbox: queue.Queue[dict[str, Any]]
    welcome: AgentWelcome


Early = list[tuple[float, Connection, dict[str, Any]]]  # (arrival, connection, message)


def refuse_all(server: ControlServer, early: Early, keep_s: float, serving: int = 0) -> None:
    """Sort out who reached this agent's failover server while it is not (yet) a candidate.
    Votes and reconnects are kept for ``keep_s`` (a lease): this agent may notice the loss a
    moment after its peers and stand next; anything else, or older, is hung up. So is, at once,
    a vote or reconnect for a term up to ``serving``, the term of the coordinator this agent
    serves: it can never stand for that one, and a worker kept waiting here would reach the
    winner only after its gather window (a lease) had closed, and be replaced."""
    now = time.monotonic()
    while True:
        try:
            conn, raw = server.inbox.get_nowait()
        except queue.Empty:
            break
        kept = any(c is conn for _, c, _ in early)
        if raw.get("type") == "_closed":
            # gone before anyone stood: forget its hello, or a winner would count a worker that
            # reconnects elsewhere as reconnected here, and refuse its next hello as a second one
            early[:] = [e for e in early if e[1] is not conn]
        elif raw.get("type") in ("vote", "hello") and not _settled(raw, serving):
            early.append((now, conn, raw))
        elif kept:
            # a kept worker's next message (the Stopped its interrupted step sends right after
            # its hello): kept in order for the winner's first round, like the hello
            early.append((now, conn, raw))
        else:
            conn.hang_up()
    expired = [e[1] for e in early if e[2].get("type") in ("vote", "hello")]
    expired = [c for c in expired if _expired(early, c, now, keep_s, serving)]
    for conn in expired:
        early[:] = [e for e in early if e[1] is not conn]
        conn.hang_up()


def _expired(early: Early, conn: Connection, now: float, keep_s: float, serving: int) -> bool:
    """Whether the vote or hello ``conn`` opened with is too old, or for a settled term."""
    first = next(e for e in early if e[1] is conn)
    return now - first[0] > keep_s or _settled(first[2], serving)


def _settled(raw: dict[str, Any], serving: int) -> bool:
    term = raw.get("term")
    return isinstance(term, int) and not isinstance(term, bool) and 0 < term <= serving


def _vote(term: int, me: int, host: str, agent: Agent, failover: str) -> Vote:
    procs = sorted(agent.procs.items())
    return Vote(
        term=term,
        agent_id=me,
        host=host,
        worker_ids=[wid for wid, _ in procs],
        roles=[p.role for _, p in procs],
        pids=[p.handle.pid for _, p in procs],
        stores=[f"{host}:{p.store_port}" if p.store_port else "" for _, p in procs],
        failover=failover,
        connected=[p.connected for _, p in procs],
        finished_workers=[wid for wid in sorted(agent.finished)],
        finished_ranks=[agent.finished[wid][0] for wid in sorted(agent.finished)],
        finished_codes=[agent.finished[wid][1] for wid in sorted(agent.finished)],
    )


def elect(
    *,
    me: int,
    host: str,
    succession: Succession,
    ballot: Ballot,
    server: ControlServer,
    secret: bytes,
    agent: Agent,
    detected: float,
    why: str,
    old: str,
    stop: list[int],
    early: Early,
) -> Mandate | Joined | None:
    """Run terms until this agent wins (a :class:`Mandate`), is welcomed by the winner
    (:class:`Joined`) or the lease since ``detected`` runs out (None: fence)."""
    deadline = detected + succession.lease
    window = max(1.0, succession.lease / 3)
    members = list(succession.members)
    addresses = dict(zip(succession.successors, succession.addresses, strict=False))
    mine = f"{server.address[0]}:{server.address[1]}"
    term = max(ballot.voted, succession.term)
    while time.monotonic() < deadline and not stop:
        term += 1
        candidate = candidate_for(term, succession.successors)
        if not ballot.cast(term):
            continue
        end = min(deadline, time.monotonic() + window)
        if candidate == me:
            log.warning("coordinator lost (%s); standing for term %d", why, term)
            won = _collect(term, me, host, members, server, end, stop, early)
            if won is not None:
                voters, pending = won
                return Mandate(
                    term=term,
                    agent_id=me,
                    host=host,
                    old=old,
                    why=why,
                    detected=detected,
                    elected=time.monotonic(),
                    members=members,
                    voters=voters,
                    pending=pending,
                )
            continue
        joined = _ask(
            term, candidate, addresses.get(candidate, ""), me, host, agent, mine, secret, end, server, early
        )
        if joined is not None:
            return joined
    log.error("no coordinator won a majority within the lease (%.1f s); fencing", succession.lease)
    return None


def _collect(
    term: int,
    me: int,
    host: str,
    members: list[int],
    server: ControlServer,
    end: float,
    stop: list[int],
    early: Early,
) -> tuple[dict[Connection, Vote], list[tuple[Connection, dict[str, Any]]]] | None:
    """As the candidate: gather votes until a majority or ``end``; workers' hellos are kept.
    What arrived before this agent stood (``early``) counts first."""
    votes: dict[Connection, Vote] = {}
    pending: list[tuple[Connection, dict[str, Any]]] = []
    for _, conn, raw in early:
        server.inbox.put((conn, raw))
    early.clear()
    while not has_quorum({me, *(v.agent_id for v in votes.values())}, members):
        left = end - time.monotonic()
        if left <= 0 or stop:
            for conn in [*votes, *(c for c, _ in pending)]:
                conn.hang_up()  # they move on to the next term
            log.warning(
                "term %d: %d of %d votes, no majority; giving it up", term, len(votes) + 1, len(members)
            )
            return None
        try:
            conn, raw = server.inbox.get(timeout=min(left, 0.02))
        except queue.Empty:
            continue
        if raw.get("type") == "_closed":
            votes.pop(conn, None)
            pending = [(c, r) for c, r in pending if c is not conn]
            continue
        try:
            msg = decode(raw)
        except ProtocolError:
            conn.hang_up()
            continue
        if isinstance(msg, Vote) and msg.term == term and msg.agent_id in members:
            if msg.agent_id in {v.agent_id for v in votes.values()} or msg.agent_id == me:
                conn.hang_up()
            else:
                votes[conn] = msg
        elif isinstance(msg, Hello) and 0 < msg.term <= term:
            pending.append((conn, raw))
        elif any(c is conn for c, _ in pending):
            pending.append((conn, raw))  # a kept worker's next report: in order, for the first round
        else:
            conn.hang_up()  # another term's vote or reconnect: that one goes elsewhere
    log.warning("term %d: majority of %s reached (%d votes)", term, members, len(votes) + 1)
    return votes, pending


def _ask(
    term: int,
    candidate: int,
    address: str,
    me: int,
    host: str,
    agent: Agent,
    mine: str,
    secret: bytes,
    end: float,
    own: ControlServer,
    early: Early,
) -> Joined | None:
    """As a voter: vote for ``candidate`` and wait for its welcome (it needs a majority first)."""
    addr, _, port = address.rpartition(":")
    if not addr or not port.isdigit():
        return None
    inbox: queue.Queue[dict[str, Any]] = queue.Queue()
    try:
        client = ControlClient(
            (addr, int(port)),
            secret,
            inbox.put,
            lambda why: inbox.put({"type": LOST, "why": why}),
            timeout=max(0.1, min(1.0, end - time.monotonic())),
        )
    except ConnectionError:
        time.sleep(0.05)  # a dead candidate refuses at once; do not spin through the terms
        return None
    try:
        client.send(encode(_vote(term, me, host, agent, mine)))
    except OSError:
        client.close()
        return None
    # the candidate's window may have started a little later than ours: allow it that much more
    wait_end = end + 1.0
    while time.monotonic() < wait_end:
        refuse_all(own, early, end - time.monotonic() + 5.0)
        try:
            raw = inbox.get(timeout=max(0.01, min(0.1, wait_end - time.monotonic())))
        except queue.Empty:
            continue
        if raw.get("type") == LOST:
            break
        try:
            msg = decode(raw)
        except ProtocolError:
            break
        if isinstance(msg, AgentWelcome) and msg.term == term:
            log.warning("joined the coordinator of term %d (agent %d at %s)", term, candidate, address)
            return Joined(client, inbox, msg)
    client.close()
    return None
