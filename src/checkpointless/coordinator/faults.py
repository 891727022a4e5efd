"""Faults as the coordinator meets them: a fault recorded against the budget, a round begun, a
process that exited, a spare lost, a host lost, hangs judged from the heartbeats, and each round's
report once it has settled. Functions of the :class:`Coordinator` they act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpointless.coordinator.downtime import recovery_fields
from checkpointless.coordinator.rules.budget import (
    FaultRecord,
    budget_verdict,
    first_step_limit,
    progress_limit,
    start_failure_verdict,
)
from checkpointless.coordinator.rules.decisions import WorkerHealth, find_hung
from checkpointless.coordinator.spares import refill_spares
from checkpointless.coordinator.state import RETIRED, Member, Round
from checkpointless.errors import NotRecoverableError
from checkpointless.protocol import Abort

if TYPE_CHECKING:
    from checkpointless.coordinator.coordinator import Coordinator


__all__ = [
    "begin_round",
    "check_hangs",
    "flush_pending",
    "host_lost",
    "process_exited",
    "record_fault",
    "report_recovery",
    "spare_lost",
    "start_failed",
]


def record_fault(
    c: Coordinator,
    rank: int,
    kind: str,
    detail: str,
    replace: bool,
    now: float,
    wall: float,
    step: int | None = None,
) -> None:
    """Record a fault on ``rank`` and make sure a round is handling it."""
    if step is None:  # as the rank last said in a heartbeat (it could not tell us itself)
        step = c.ranks[rank].step if rank in c.ranks else None
    record: dict[str, Any] = {
        "time": wall,
        "event": "fault",
        "job": c.job_id,
        "rank": rank,
        "kind": kind,
        "detail": detail,
        "generation": c.generation,
        "step": step,
    }
    c._emit("fault", **{k: v for k, v in record.items() if k not in ("event", "job")})
    c._log("warning", f"FAULT rank {rank}: {kind} ({detail}) at step {step}")
    record["detected"] = now
    c.fault_history.append(FaultRecord(rank, kind, step, detail))
    why = budget_verdict(c.fault_history, c.cfg.fault_window, c.cfg.max_repeat_faults)
    if why is not None:
        raise NotRecoverableError(why)
    r = c.round
    if r is None or r.phase == "rebuild":
        begin_round(c, record, now)
    else:
        r.faults.append(record)
    assert c.round is not None
    if replace:
        c.round.replace.add(rank)
        c.round.reports.pop(rank, None)


def begin_round(c: Coordinator, first_fault: dict[str, Any], now: float) -> None:
    prev = c.round
    target = (prev.target if prev is not None else c.generation) + 1
    # a generation that never formed its first state sync still needs it
    initial = prev is not None and prev.initial
    r = Round(target=target, initial=initial, started=now, abort_sent=now)
    r.faults.append(first_fault)
    if prev is not None:  # a fault while a generation was forming: keep the earlier faults
        r.faults = prev.faults + r.faults
        r.started = prev.started
        r.replace = set(prev.replace)
        r.moving = dict(prev.moving)  # a lost host's ranks still go where the first of them went
    c.round = r
    flush_pending(c, "superseded by a new fault before every rank committed a step")
    for rank, m in c.ranks.items():
        # a rank past its loop is in the script's own code: nothing of ours to abort there
        if rank not in r.replace and not m.done:
            c._send(m, Abort(generation=target, reason=first_fault["detail"]))


def process_exited(
    c: Coordinator,
    worker_id: int,
    code: int,
    own_failure: bool,
    detail: str,
    tail: str,
    now: float,
    wall: float,
) -> None:
    m = c.procs.pop(worker_id, None)
    if m is None:
        return
    m.exited = True
    m.exit_code = code
    c.table.forget(worker_id)
    m.connected = False
    if m.rank is None or c.ranks.get(m.rank) is not m:
        if m.role == "spare":
            spare_lost(c, m, code, own_failure, detail, tail, now)
        return
    if m.done:
        if code != 0:  # its work was complete: the final barrier had passed everywhere
            c._log("warning", f"rank {m.rank} exited with code {code} after finishing")
        return
    if m.killed_for is not None:
        kind = "hang"
    elif code < 0:
        kind = "killed"
    else:
        kind = "exit"
    if not m.joined and own_failure:
        start_failed(c, m.rank, detail, tail)
    record_fault(c, m.rank, kind, detail, True, now, wall)


def spare_lost(
    c: Coordinator, m: Member, code: int, own_failure: bool, detail: str, tail: str, now: float
) -> None:
    c._emit("spare_lost", worker=m.worker_id, code=code)
    c.moving_spares.discard(m.worker_id)
    retired = m.killed_for == RETIRED
    if not m.ready and own_failure and not retired:  # a spare we stopped did not fail to start
        c._early_spare_deaths += 1
    elif m.ready:
        c._early_spare_deaths = 0
    if c._early_spare_deaths >= c.cfg.max_start_failures:
        raise NotRecoverableError(
            f"{c._early_spare_deaths} spare processes in a row failed before they were ready "
            f"(last: {detail}); the script fails before or inside checkpointless.init(), so every "
            "replacement would too. Fix what its output shows" + (f":\n{tail}" if tail else "")
        )
    if not retired:
        c._log("warning", f"spare {m.worker_id} exited (code {code}); starting another")
    refill_spares(c, now)


def start_failed(c: Coordinator, rank: int, detail: str, tail: str) -> None:
    """A process died before it ever joined as its rank: count it against a respawn loop."""
    n = c.start_failures.get(rank, 0) + 1
    c.start_failures[rank] = n
    why = start_failure_verdict(rank, n, c.cfg.max_start_failures, detail, tail)
    if why is not None:
        raise NotRecoverableError(why)


def check_hangs(c: Coordinator, now: float, wall: float) -> None:
    if any(m.killed_for and not m.exited for m in c.ranks.values()):
        return  # a culprit is being killed: its exit starts the round; judge nobody meanwhile
    health = []
    for rank, m in c.ranks.items():
        if m.exited or m.killed_for is not None or not m.connected:
            continue  # a process still starting is judged from the process table (the agent)
        # a rank past its loop (Done) makes no step progress by design: its script may save or
        # evaluate for a long time before it leaves; only its silence (a stopped process) counts
        judged = m.progress_known and c.round is None and not m.done
        progress = m.last_progress if judged else now
        # no step time yet: this process has not finished a step (its first may be compiling)
        health.append(WorkerHealth(rank, m.last_message, progress, m.in_collective, m.step_time is None))
    times = [m.step_time for m in c.ranks.values() if m.step_time is not None]
    limit = progress_limit(c.cfg.hang_timeout, c.cfg.hang_factor, times)
    first = first_step_limit(limit, c.cfg.first_step_timeout)
    r = c.round
    if r is not None and r.phase == "collect" and not r.initial:
        # a member that keeps its heartbeat but never leaves its step after the abort (a busy
        # loop) holds the round up: it is hung like a process that stopped
        for rank, m in c.ranks.items():
            waiting = rank not in r.reports and rank not in r.replace and m.connected and not m.done
            # A spare given the rank this round reports only once it reaches job.steps(): it
            # first runs the script's set-up after init() (the model to its device, fully_shard,
            # the optimizer, the data loader), which has the first step's allowance, not the
            # step-time limit. A stopped one is still caught by its silence.
            allowed = limit if m.joined else first
            if waiting and now - max(r.abort_sent, m.assigned_at) > allowed:
                what = "leave its step" if m.joined else "report after it was given its rank"
                why = f"did not {what} within {allowed:.1f} s of the abort"
                c._log("warning", f"rank {rank} {why}; killing it")
                c._kill(m, why)
                return
    culprits, why = find_hung(health, now, c.cfg.hang_timeout, limit, first)
    if not culprits and why and c.round is None:
        # everyone waits for everyone (a lost message, a wedged link): nobody to replace,
        # but the collective will never finish; rebuild the communicator with the same ranks
        record_fault(c, min(h.rank for h in health), "stall", why, False, now, wall)
        return
    for rank in culprits:
        c._log("warning", f"rank {rank} is hung: {why}; killing it")
        c._kill(c.ranks[rank], why)


# -- rounds -------------------------------------------------------------------------------


def host_lost(c: Coordinator, host: int, why: str, now: float, wall: float) -> None:
    h = c.hosts.get(host)
    if h is None or h.lost:
        return
    h.lost = True
    lost = sorted(wid for wid, m in c.procs.items() if m.host == host)
    ranks = sorted(m.rank for m in c.procs.values() if m.host == host and m.rank is not None)
    c._emit("host_lost", host=host, address=h.address, why=why, ranks=ranks, processes=len(lost))
    c._log("warning", f"host {h.address} (agent {host}) lost: {why}; ranks {ranks} move to spares")
    for wid in lost:
        process_exited(c, wid, -9, False, f"host {h.address} lost: {why}", "", now, wall)


def flush_pending(c: Coordinator, why: str) -> None:
    """Report a recovery whose first step never completed everywhere: every round that formed
    a generation is counted and reported, even when the job ended (or another fault came)
    before its first step did."""
    pend, c.pending = c.pending, None
    if pend is not None:
        report_recovery(c, pend, None, why)


def report_recovery(
    c: Coordinator, r: Round, first_step_done: float | None, incomplete: str | None = None
) -> None:
    fields, summary, used_fired = recovery_fields(
        r, first_step_done, c.first_batches, c._fired_at, incomplete
    )
    if used_fired:
        c._fired_at = None
    c._emit("recovery", **fields)
    c.recoveries.append(fields)
    c._log("info", summary)


# -- time ---------------------------------------------------------------------------------
