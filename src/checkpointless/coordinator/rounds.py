"""A recovery round after it has begun: members report where they stopped, ranks are handed to
spares, the plan goes out, and the round ends when every rank has recovered and committed.
Functions of the :class:`Coordinator` they act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointless.coordinator.faults import record_fault, report_recovery
from checkpointless.coordinator.rules.decisions import MemberReport, SpareAction, plan_recovery, spare_policy
from checkpointless.coordinator.rules.placement import match_spares, move_chain, without_spare
from checkpointless.coordinator.spares import refill_spares, retire_squeezed
from checkpointless.coordinator.state import Member, Round
from checkpointless.coordinator.tables import give_table
from checkpointless.errors import NotRecoverableError
from checkpointless.peer_table import compact_plan
from checkpointless.protocol import Committed, Prepare, Recover, Recovered, Stopped

if TYPE_CHECKING:
    from checkpointless.coordinator.coordinator import Coordinator


__all__ = ["advance_round", "on_committed", "on_recovered", "on_stopped", "replace_ranks"]


def on_stopped(c: Coordinator, m: Member, msg: Stopped, now: float, wall: float) -> None:
    rank = m.rank
    if rank is None or c.ranks.get(rank) is not m:
        return
    gen = msg.for_generation
    r = c.round
    if r is not None and r.phase == "rebuild" and gen <= r.target and msg.cause != "recovery":
        return  # a duplicate of a report this round already has
    if r is None and gen <= c.generation:
        return  # stale: about a generation that has already formed
    if r is None or r.phase == "rebuild":
        # a rank stopped by itself: that is a fault (its own exception, a failed collective
        # or a failed recovery step) unless a round already covers it
        kind = msg.cause if msg.cause in ("exception", "recovery") else "comm"
        record_fault(c, rank, kind, str(msg.error), False, now, wall, step=msg.step)
    r = c.round
    assert r is not None
    if gen != r.target or r.phase != "collect":
        return
    r.reports[rank] = MemberReport(
        rank,
        msg.committed_step,
        msg.valid,
        msg.snapshot_step,
        msg.checkpoint_step,
        checkpoint_steps=tuple(msg.checkpoint_steps),
        mesh=(msg.mesh[0], msg.mesh[1]) if msg.mesh and len(msg.mesh) == 2 else None,
        copies=tuple((c[0], c[1]) for c in msg.copies if len(c) == 2),
        own_snapshots=tuple(msg.own_snapshots),
    )
    r.report_times[rank] = now


def advance_round(c: Coordinator, now: float) -> None:
    r = c.round
    if r is None or r.phase != "collect":
        return
    done = sorted(k for k, m in c.ranks.items() if m.done)
    if done:
        # Some rank has left its loop, so every rank passed the last step's collectives: there
        # is no step left to recover into. The rest only need to finish (_check_done ends the
        # job). A rank lost meanwhile cannot be rebuilt from peers that have left, and one that
        # stopped for this round (an abort that caught it in the final barrier) waits for a
        # plan that cannot form without them: say so now rather than at a timeout.
        lost = sorted(r.replace)
        caught = sorted(k for k in r.reports if not c.ranks[k].done)
        if lost or caught:
            what = f"rank(s) {lost} were lost" if lost else f"rank(s) {caught} were interrupted"
            raise NotRecoverableError(
                f"{what} after training finished (rank(s) {done} had left the loop): nothing is "
                "left to recover them with, and their work after the loop did not run"
            )
        if now - r.started > c.cfg.recovery_timeout:
            raise NotRecoverableError(
                f"generation {r.target}: ranks {sorted(set(c.ranks) - set(done))} neither "
                "finished nor reported within --recovery-timeout after the others finished"
            )
        return
    if r.replace:
        replace_ranks(c, r, sorted(r.replace), now)
        return
    if len(r.reports) < c.cfg.nproc:
        if now - r.started > c.cfg.recovery_timeout:
            missing = sorted(set(range(c.cfg.nproc)) - set(r.reports))
            raise NotRecoverableError(
                f"generation {r.target}: ranks {missing} never reported within --recovery-timeout"
            )
        return
    plan = plan_recovery([r.reports[k] for k in sorted(r.reports)], initial=r.initial)
    # every round counts, the start-up ones too: a recovery that fails the same way each time
    # must end the job, not spin through generations. Progress is a fault at a later step than
    # any before: a plan that restores the same older snapshot each time keeps its target while
    # the job trains past it between faults, and that is no loop.
    reached = max((f["step"] for f in r.faults if f.get("step") is not None), default=-1)
    stuck = plan.target_step == c._last_target and reached <= c._last_reached
    c._same_target = c._same_target + 1 if stuck else 1
    c._last_target = plan.target_step
    c._last_reached = max(c._last_reached, reached)
    if c._same_target > c.cfg.max_step_failures + (1 if r.initial else 0):
        raise NotRecoverableError(
            f"faults keep recurring at step {plan.target_step}: {c._same_target} recoveries in a "
            "row made no progress; this looks like a bug or a bad node, not a transient fault "
            "(raise --max-step-failures to allow more)"
        )
    plan_json = plan.to_json()
    # one Recover for every member, and of a size that does not grow with the job: the plan's
    # rank lists as ranges, the peer table as a delta (peer_table.py). A member that does not
    # hold the version the delta applies to gets the full table first, in chunks.
    rootless, t = c.rendezvous["kind"] == "rootless", c.table
    if rootless:
        t.update([c.ranks[k].store_address for k in range(c.cfg.nproc)])
    msg = Recover(
        generation=r.target,
        rendezvous=dict(c.rendezvous),
        plan=compact_plan(plan_json),
        table_version=t.version if rootless else -1,
        table_base=t.base if rootless else -1,
        table_digest=t.digest if rootless else "",
        moved_ranks=[rank for rank, _ in t.moved],
        moved_to=[address for _, address in t.moved],
    )
    sends, hosts = c.table_sends, c.host_tables
    for m in c.ranks.values():
        if rootless and t.needs_full(m.worker_id):
            give_table(c, m)
        elif m.connected and not m.exited:
            t.sent(m.worker_id)
    for m in c.ranks.values():  # after every host's copy: a remote agent gets it first
        c._send(m, msg)
    r.phase = "rebuild"
    r.plan_sent = now
    # whole tables this round sent to hosts' agents and to single members (agent/tables.py)
    tables = {"hosts": c.host_tables - hosts, "members": c.table_sends - sends}
    c._emit("plan", generation=r.target, peer_tables=tables, **plan_json)


def replace_ranks(c: Coordinator, r: Round, ranks: list[int], now: float) -> None:
    # a spare being stopped (retired: spares.retire_squeezed) is neither offered nor awaited
    spares = [m for m in c.procs.values() if m.role == "spare" and m.rank is None and m.killed_for is None]
    pool = [(m.worker_id, m.host) for m in spares if m.ready and m.connected]
    live = {h.host for h in c.hosts.values() if not h.lost}
    holding = {m.host for m in c.ranks.values() if m.host in live}
    old_host = {rank: c.ranks[rank].host if rank in c.ranks else -1 for rank in ranks}
    match = match_spares([(rank, old_host[rank]) for rank in ranks], pool, holding, r.moving)
    unmatched = [rank for rank in ranks if rank not in match]
    # a starting spare counts as on its way only to a rank it could take: one beside other
    # ranks takes only its own host's rank (match_spares), so it never serves a lost host's
    starting = [m.host for m in spares if not m.ready]
    bare = without_spare([(rank, old_host[rank]) for rank in unmatched], starting, holding, r.moving)
    if r.waiting_since is None:
        r.waiting_since = now
    coming = len(unmatched) - len(bare)
    d = spare_policy(len(match), coming, len(ranks), now - r.waiting_since, c.cfg.spare_wait)
    if d.action == SpareAction.FAIL:
        raise NotRecoverableError(d.reason)
    c._condition(
        "spare_wait",
        bool(unmatched),
        f"no hot spare ready for rank(s) {unmatched}; starting spares (waits up to {c.cfg.spare_wait:.0f} s)",
    )
    for rank in bare[: d.spawn]:
        # a rank whose host lives gets its spare there (its device is free); a lost host's rank
        # needs a spare host, and a spare squeezed onto another rank host could not take it
        host = old_host[rank]
        if host in live:
            c._spawn("spare", now, host=host)
        elif (to := move_chain(host, r.moving)[-1]) in live:
            # the rest of a lost host's ranks follow the first to its spare host (the newest one
            # they moved to, if that spare host was lost in turn)
            c._spawn("spare", now, host=to)
        else:
            c._spawn("spare", now, strict=True)
    if d.action == SpareAction.WAIT and not match:
        return
    for rank in sorted(match):
        spare = c.procs[match[rank]]
        old = c.ranks.get(rank)
        if old is not None:
            c._kill(old, old.killed_for or "replaced")
        c.ranks[rank] = spare
        # the lost host its peers are to follow it from: the last of its moves so far
        if (lost := move_chain(old_host[rank], r.moving)[-1]) not in live:
            r.moving.setdefault(lost, spare.host)
        c._assign(spare, rank, r.target, now, initial=r.initial)
        r.replace.discard(rank)  # settled once the spare reports; re-added if it dies first
        c._emit("spare_assigned", rank=rank, worker=spare.worker_id, generation=r.target)
        c._log("info", f"spare {spare.worker_id} takes rank {rank}")
    if match:
        refill_spares(c, now)  # refill the pool in the background (once: it walks every rank)
    if not r.replace:
        c._condition("spare_wait", False)
    r.waiting_since = None


def on_recovered(c: Coordinator, m: Member, msg: Recovered, now: float) -> None:
    r = c.round
    if r is None or r.phase != "rebuild" or msg.generation != r.target or m.rank is None:
        return
    r.recovered[m.rank] = {**msg.timings, "time": now}
    m.joined = True
    c.start_failures.pop(m.rank, None)
    if len(r.recovered) < c.cfg.nproc:
        return
    c.generation = r.target
    c.round = None
    for member in c.ranks.values():
        member.last_progress = now  # the hang clock restarts with the new generation
    if r.initial:
        # a fault before every rank had formed the first generation is absorbed by start-up (no
        # recovery event: there was no step to lose); it is still named, so that every fault in
        # the job's account has a home
        causes = [{"rank": f["rank"], "kind": f["kind"], "detail": f["detail"]} for f in r.faults]
        during = f" through {len(causes)} fault(s) during start-up" if causes else ""
        c.startup_faults = len(causes)
        c._log("info", f"generation {r.target} formed in {now - r.started:.2f} s after launch{during}")
        c._emit("started", generation=r.target, seconds=now - r.started, faults=causes)
        c.refill_after_round = False
        refill_spares(c, now)
        return
    if c.refill_after_round:
        c.refill_after_round = False
        refill_spares(c, now)
    if c.moving_spares:
        retire_squeezed(c)  # spares moved to a joined host that became ready during the round
    c.pending = r
    c.first_commits = {}
    c.first_batches = {}


def on_committed(c: Coordinator, m: Member, msg: Committed, now: float) -> None:
    size = msg.state_bytes
    if size is not None and size > c.state_bytes:
        # spares page in room for this much state while they wait (see state/arena.py)
        c.state_bytes = size
        for spare in c.procs.values():
            if spare.role == "spare" and spare.rank is None and spare.ready:
                c._send(spare, Prepare(size))
    pend = c.pending
    if pend is None or m.rank is None or msg.generation != c.generation:
        return
    c.first_commits[m.rank] = now
    if msg.first_batch_s is not None:
        c.first_batches[m.rank] = msg.first_batch_s
    if len(c.first_commits) < c.cfg.nproc:
        return
    c.pending = None
    report_recovery(c, pend, max(c.first_commits.values()))
