"""What the workers say: each message from a worker's control connection applied to the
coordinator, and a heartbeat applied to its member (sent directly, or published for its agent).

Kept apart from the coordinator's interface to the shell: this is the dispatch on the message's
type, while the round's own messages (``Stopped``, ``Recovered``, ``Committed``) are handled in
``rounds.py`` and the peer table's delivery in ``tables.py``. Functions of the
:class:`Coordinator` they act on (``apply_heartbeat`` only of the member).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointless.coordinator.rounds import on_committed, on_recovered, on_stopped
from checkpointless.coordinator.spares import retire_squeezed
from checkpointless.coordinator.state import Member
from checkpointless.coordinator.tables import send_table
from checkpointless.errors import NotRecoverableError
from checkpointless.protocol import (
    Committed,
    Done,
    DoneSeen,
    Fatal,
    Fired,
    Heartbeat,
    Message,
    PeerTableRequest,
    Prepare,
    Recovered,
    SpareReady,
    Stopped,
)

if TYPE_CHECKING:
    from checkpointless.coordinator.coordinator import Coordinator


__all__ = ["apply_heartbeat", "handle"]


def handle(c: Coordinator, worker_id: int, msg: Message, now: float, wall: float) -> None:
    """One message from ``worker_id`` (the coordinator runs it guarded: a ``Fatal`` ends the job)."""
    m = c.procs.get(worker_id)
    if m is None:
        return
    m.last_message = now
    if isinstance(msg, Heartbeat):
        apply_heartbeat(m, now, msg.step, msg.progress_age, msg.in_collective, msg.step_time, msg.busy_time)
    elif isinstance(msg, PeerTableRequest):
        # the host's copy failed this member (none, not yet there, or not matching): worth
        # seeing, since every member of a host asking costs what the copy was meant to save
        c._emit("peer_table_request", worker=m.worker_id, rank=m.rank, host=m.host, have=msg.have)
        send_table(c, m)
    elif isinstance(msg, SpareReady):
        m.ready = True
        c._early_spare_deaths = 0
        c._emit("spare_ready", worker=m.worker_id)
        if c.state_bytes:
            c._send(m, Prepare(c.state_bytes))
        if c.round is None and m.worker_id in c.moving_spares:
            retire_squeezed(c)
    elif isinstance(msg, Fired):
        c.fired.add(msg.id)
        c._fired_at = msg.time
        c._emit("fault_injected", rank=m.rank, id=msg.id, kind=msg.kind, fired_at=msg.time)
    elif isinstance(msg, Stopped):
        on_stopped(c, m, msg, now, wall)
    elif isinstance(msg, Recovered):
        on_recovered(c, m, msg, now)
    elif isinstance(msg, Committed):
        on_committed(c, m, msg, now)
    elif isinstance(msg, Done):
        m.done = True
        c._send(m, DoneSeen())  # on many hosts it waits for this before it leaves
    elif isinstance(msg, Fatal):
        raise NotRecoverableError(f"rank {m.rank}: {msg.error}")


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
