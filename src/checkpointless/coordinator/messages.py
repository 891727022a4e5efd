"""What the workers say: each message from a worker's control connection routed to the component
that owns what it is about, and a heartbeat applied to its member (sent directly, or published for
its agent and reported in the agent's aggregate).
"""

from __future__ import annotations

from checkpointless.coordinator.ledger import FaultLedger
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rounds import Rounds
from checkpointless.coordinator.rules.fatal import config_error_verdict
from checkpointless.coordinator.state import Member
from checkpointless.coordinator.tables import TableDelivery
from checkpointless.errors import NotRecoverableError
from checkpointless.protocol import (
    Committed,
    Done,
    DoneSeen,
    Fatal,
    Fired,
    FiredSeen,
    Heartbeat,
    Inexact,
    Message,
    PeerTableRequest,
    Recovered,
    ReplayDiffers,
    SpareReady,
    Stopped,
)

__all__ = ["MessageRouter", "apply_heartbeat"]


class MessageRouter:
    def __init__(
        self, members: Members, outbox: Outbox, ledger: FaultLedger, tables: TableDelivery, rounds: Rounds
    ) -> None:
        self.members = members
        self.outbox = outbox
        self.ledger = ledger
        self.tables = tables
        self.rounds = rounds

    def handle(self, worker_id: int, msg: Message, now: float, wall: float) -> None:
        """One message from ``worker_id``, to the component it is about (run guarded: a
        ``Fatal`` ends the job)."""
        m = self.members.procs.get(worker_id)
        if m is None:
            return
        m.last_message = now
        out = self.outbox
        if isinstance(msg, Heartbeat):
            apply_heartbeat(
                m, now, msg.step, msg.progress_age, msg.in_collective, msg.step_time, msg.busy_time
            )
        elif isinstance(msg, PeerTableRequest):
            # the host's copy failed this member (none, not yet there, or not matching): worth
            # seeing, since every member of a host asking costs what the copy was meant to save
            out.emit("peer_table_request", worker=m.worker_id, rank=m.rank, host=m.host, have=msg.have)
            self.tables.send_table(m)
        elif isinstance(msg, SpareReady):
            m.ready = True
            self.ledger.spare_ready()
            out.emit("spare_ready", worker=m.worker_id)
            self.rounds.on_spare_ready(m)
        elif isinstance(msg, Fired):
            if msg.step >= 0:
                m.announced_step = msg.step  # its fault event's step, should it die of it
            self.ledger.fault_fired(msg.id, msg.time)
            out.emit("fault_injected", rank=m.rank, id=msg.id, kind=msg.kind, fired_at=msg.time)
            out.send(m, FiredSeen(id=msg.id))  # a fault that ends its process waits for this
        elif isinstance(msg, Stopped):
            m.announced_step = None  # it lived to report its own step: an announcement is spent
            self.rounds.on_stopped(m, msg, now, wall)
        elif isinstance(msg, Recovered):
            self.rounds.on_recovered(m, msg, now)
        elif isinstance(msg, Committed):
            self.rounds.on_committed(m, msg, now)
        elif isinstance(msg, Done):
            m.done = True
            out.send(m, DoneSeen())  # on many hosts it waits for this before it leaves
        elif isinstance(msg, Inexact):  # the job goes on, but says it may no longer be exact
            self.ledger.resumed_inexact(m.rank, msg.step, msg.what, msg.detail)
        elif isinstance(msg, ReplayDiffers):  # a replay that is not the step it replays
            self.ledger.replay_differed(m.rank, msg.step, msg.generation, msg.interrupted, msg.replayed)
        elif isinstance(msg, Fatal):
            if msg.kind == "config":  # a ConfigError ended its script: a replacement would raise it too
                raise NotRecoverableError(config_error_verdict(_who(m), msg.error))
            if msg.kind == "retries" and m.rank is not None:
                # its in-process retries of a step are used up: unless a fresh process may not
                # try it (raised), its process ends and a spare takes the rank, as for any exit
                self.ledger.retries_spent(m.rank, m.step, msg.error, self.rounds.generation, msg.tries)
                return
            raise NotRecoverableError(f"rank {m.rank}: {msg.error}")


def _who(m: Member) -> str:
    return f"rank {m.rank}" if m.rank is not None else f"spare {m.worker_id}"


def apply_heartbeat(
    m: Member,
    at: float,
    step: int | None,
    progress_age: float | None,
    in_collective: bool,
    step_time: float | None,
    busy_time: float | None = None,
) -> None:
    """A heartbeat the worker sent at ``at`` (directly, or published for its agent)."""
    m.last_message = at
    m.in_collective = in_collective
    if progress_age is not None:
        m.progress_known = True
        m.last_progress = at - progress_age
    m.step = step
    if step_time is not None:
        m.step_time = step_time
    if busy_time is not None:
        m.busy_time = busy_time
