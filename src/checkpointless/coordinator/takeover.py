"""A new coordinator after a failover: a :class:`Coordinator` set up from a rebuilt state.

Pure like the coordinator itself: the hosts that voted, the processes their agents reported, what
the workers said when they reconnected (coordinator/rules/rebuild.py) and the times, in; a coordinator
with its ranks, its spares and its first round out, the round's ``Abort`` and ``Kill`` commands
queued. The round is an ordinary one for the next generation, so every rank leaves the step it
was in, spares take the ranks nobody holds, and the interrupted step is replayed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from checkpointless.coordinator.coordinator import Coordinator
from checkpointless.coordinator.rules.rebuild import ProcReport, Rebuilt, WorkerReport
from checkpointless.coordinator.state import HostState, Member, Round
from checkpointless.protocol import Abort, DoneSeen

__all__ = ["TakeoverHost", "resume"]


@dataclass(frozen=True)
class TakeoverHost:
    host: int  # the agent id (kept from the old coordinator)
    address: str
    remote: bool  # False for the new coordinator's own agent


def resume(
    coord: Coordinator,
    hosts: Iterable[TakeoverHost],
    procs: Iterable[ProcReport],
    workers: Iterable[WorkerReport],
    rebuilt: Rebuilt,
    why: str,
    detected: float,
    wall: float,
    now: float,
) -> None:
    """Set ``coord`` (fresh, not started) up from the rebuilt state and open its first round.
    ``detected`` is the monotonic time the old coordinator was found lost."""
    for h in hosts:
        coord.hosts[h.host] = HostState(h.host, h.address, h.remote, now)
    said = {w.worker_id: w for w in workers}
    for p in procs:
        m = Member(
            worker_id=p.worker_id, role=p.role, spawned=now, host=p.host, store_address=p.store_address
        )
        w = said.get(p.worker_id)
        m.connected = m.greeted = w is not None
        m.ready = w is not None and w.ready
        m.joined = w is not None and w.generation >= 0
        m.done = w is not None and w.done  # its Done went to the lost coordinator, or nowhere
        if w is not None and w.step >= 0:
            m.step = w.step
        coord.procs[p.worker_id] = m
    for rank, wid in rebuilt.ranks.items():
        m = coord.procs[wid]
        m.rank = rank
        coord.ranks[rank] = m
    for rank, f in rebuilt.finished.items():
        # gone already: done and exited, as the lost coordinator would have recorded them
        m = Member(worker_id=f.worker_id, role="worker", spawned=now, host=f.host, rank=rank)
        m.done = m.exited = m.joined = True
        m.exit_code = f.code
        coord.ranks[rank] = m
    coord.next_worker_id = rebuilt.next_worker_id
    coord.generation = rebuilt.generation - 1
    coord.started = True
    # the coordinator's own command path: it records why, and the shell routes it to the host
    for wid in rebuilt.kill:
        coord.procs[wid].connected = False
        coord.outbox.kill(coord.procs[wid], "not vouched for after the coordinator failover")
    if not rebuilt.formed:
        coord.fail(
            "the coordinator was lost before generation 0 formed: no rank has state to keep; "
            "start the job again"
        )
        return
    done = sorted(r for r, m in coord.ranks.items() if m.done)
    if done:
        # The last steps ran while no coordinator existed: training is over everywhere, and
        # the ranks wait at their exit until their Done is seen. Nothing to abort or replay.
        for rank in done:
            if not coord.ranks[rank].exited:
                coord.outbox.send(coord.ranks[rank], DoneSeen())
        if rebuilt.missing:
            coord.fail(
                f"rank(s) {rebuilt.missing} were lost with the coordinator after training finished "
                f"(rank(s) {done} had left the loop): their work after the loop did not run"
            )
            return
        coord.outbox.log("info", f"training finished while the coordinator was lost (rank(s) {done} done)")
        return
    record = {
        "time": wall,
        "rank": rebuilt.missing[0] if rebuilt.missing else -1,
        "kind": "coordinator_lost",
        "detail": why,
        "generation": coord.generation,
        "step": max((w.step for w in said.values()), default=-1),
        "detected": detected,
    }
    coord.outbox.emit("fault", **{k: v for k, v in record.items() if k != "detected"})
    r = Round(target=rebuilt.generation, initial=False, started=detected, abort_sent=now)
    r.faults.append(record)
    r.replace = set(rebuilt.missing)
    coord.round = r
    for m in coord.ranks.values():
        coord.outbox.send(m, Abort(generation=r.target, reason=why))
