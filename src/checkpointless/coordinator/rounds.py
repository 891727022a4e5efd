"""Recovery rounds: the generation, the round open to form the next one, and the formed round
whose first step is not yet done everywhere.

A round, in brief: a fault aborts the current generation (``Abort`` to every member), dead or hung
ranks are handed to ready spares (``Assign``), every member reports where it stopped
(``Stopped``), the plan goes out (``Recover``), and once every rank has ``Recovered`` the new
generation has formed; the recovery is reported once every rank has committed a step in it
(``first_steps.py`` holds the formed round until then). The messages a round sends are built in
``round_messages.py``; the decisions are here and in the pure rules (``rules/``).
"""

from __future__ import annotations

from dataclasses import replace as with_fields
from typing import Any

from checkpointless.coordinator.degraded import DegradedMode
from checkpointless.coordinator.first_steps import FirstSteps
from checkpointless.coordinator.holders import SlotHolders, unique
from checkpointless.coordinator.ledger import FaultLedger
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.round_messages import (
    assign_message,
    member_report,
    recover_message,
    resume_plan,
)
from checkpointless.coordinator.rules.after_loop import after_the_loop
from checkpointless.coordinator.rules.budget import FaultRecord
from checkpointless.coordinator.rules.placement import match_spares, move_chain, without_spare
from checkpointless.coordinator.rules.round_wait import overdue, waiting
from checkpointless.coordinator.rules.sections import closed_sections
from checkpointless.coordinator.rules.width import WidthAction, fold_held_slots
from checkpointless.coordinator.spares import SparePool
from checkpointless.coordinator.state import Member, Round
from checkpointless.coordinator.tables import TableDelivery
from checkpointless.errors import NotRecoverableError
from checkpointless.protocol import Abort, Committed, Prepare, Recovered, Stopped
from checkpointless.settings import JobSettings as LaunchConfig

__all__ = ["Rounds"]


class Rounds:
    def __init__(
        self,
        cfg: LaunchConfig,
        job_id: str,
        rendezvous: dict[str, Any],
        checkpoint_dir: str,
        members: Members,
        outbox: Outbox,
        ledger: FaultLedger,
        spares: SparePool,
        tables: TableDelivery,
        holders: SlotHolders,
    ) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.rendezvous = rendezvous
        self.checkpoint_dir = checkpoint_dir  # where durable checkpoints go ("" when they are off)
        self.members = members
        self.outbox = outbox
        self.ledger = ledger
        self.spares = spares
        self.tables = tables
        self.generation = -1
        self.round: Round | None = None
        self.first_steps = FirstSteps(ledger, cfg.nproc)  # the formed round, until its first step
        self.state_bytes = 0  # a replica's state, as rank 0 last reported it
        self.warm: dict[str, Any] | None = None  # what spares warm up on, as rank 0 described it
        self.refill_after_round = False  # a host joined while a round ran
        self.holders = holders  # degraded mode: the lost slots survivors hold (holders.py)
        self.degraded = DegradedMode(cfg, members, outbox, spares, self.holders)

    # -- faults ---------------------------------------------------------------------------------
    def record_fault(
        self,
        rank: int,
        kind: str,
        detail: str,
        replace: bool,
        now: float,
        wall: float,
        step: int | None = None,
    ) -> None:
        """Record a fault on ``rank`` and make sure a round is handling it."""
        rank = self.holders.holder(rank)  # a held slot's process is its holder's
        ranks = self.members.ranks
        if step is None:  # as the rank last said in a heartbeat (it could not tell us itself)
            step = ranks[rank].step if rank in ranks else None
        record: dict[str, Any] = {
            "time": wall,
            "event": "fault",
            "job": self.job_id,
            "rank": rank,
            "kind": kind,
            "detail": detail,
            "generation": self.generation,
            "step": step,
        }
        self.outbox.emit("fault", **{k: v for k, v in record.items() if k not in ("event", "job")})
        self.outbox.log("warning", f"FAULT rank {rank}: {kind} ({detail}) at step {step}")
        record["detected"] = now
        self.ledger.record(rank, kind, step, detail, self.generation)
        r = self.round
        if r is None or r.phase == "rebuild":
            r = self.begin(record, now)
        else:
            r.faults.append(record)
        if replace:
            for slot in [rank, *self.holders.lose(rank)]:  # a lost holder takes its slots with it
                r.replace.add(slot)
                r.reports.pop(slot, None)

    def begin(self, first_fault: dict[str, Any], now: float) -> Round:
        prev = self.round
        target = (prev.target if prev is not None else self.generation) + 1
        # a generation that never formed its first state sync still needs it
        initial = prev is not None and prev.initial
        r = Round(target=target, initial=initial, started=now, abort_sent=now)
        r.faults.append(first_fault)
        if prev is not None:  # a fault while a generation was forming: keep the earlier faults
            r.faults = prev.faults + r.faults
            r.started = prev.started
            r.replace = set(prev.replace)
            r.moving = dict(prev.moving)  # a lost host's ranks still go where the first of them went
        self.round = r
        self.first_steps.flush("superseded by a new fault before every rank committed a step")
        gone = {
            id(self.members.ranks[k])
            for k in r.replace
            if k not in self.holders.held and k in self.members.ranks
        }
        for m in unique(self.members.ranks.values()):
            # a rank past its loop is in the script's own code: nothing of ours to abort there
            if id(m) not in gone and not m.done:
                self.outbox.send(m, Abort(generation=target, reason=first_fault["detail"]))
        return r

    def assign(self, m: Member, rank: int, generation: int, now: float, initial: bool) -> None:
        """Give ``m`` its rank (a starting worker, or a spare taking a lost rank)."""
        m.rank = rank
        self.spares.moving.discard(m.worker_id)
        m.assigned_at = now
        fired = sorted(self.ledger.fired)
        self.outbox.send(m, assign_message(self.cfg, rank, generation, fired, self.checkpoint_dir, initial))

    # -- the members' reports -------------------------------------------------------------------
    def on_stopped(self, m: Member, msg: Stopped, now: float, wall: float) -> None:
        rank = m.rank
        if rank is None or self.members.ranks.get(rank) is not m:
            return
        gen = msg.for_generation
        r = self.round
        if r is not None and r.phase == "rebuild" and gen <= r.target and msg.cause != "recovery":
            return  # a duplicate of a report this round already has
        if r is None and gen <= self.generation:
            return  # stale: about a generation that has already formed
        if r is None or r.phase == "rebuild":
            # a rank stopped by itself: that is a fault (its own exception, a failed collective
            # or a failed recovery step) unless a round already covers it
            kind = msg.cause if msg.cause in ("exception", "recovery") else "comm"
            self.record_fault(rank, kind, str(msg.error), False, now, wall, step=msg.step)
        r = self.round
        assert r is not None
        if gen != r.target or r.phase != "collect" or rank in r.replace:
            return  # (a rank to replace is settled by its new process's report)
        r.reports[rank] = member_report(rank, msg)
        if msg.cause == "exception":
            r.raised[rank] = FaultRecord(rank, "exception", msg.step, str(msg.error))
            self.ledger.raised_in_round(rank, msg.step)
        r.report_times[rank] = now
        if r.reports[rank].mesh is not None:  # degraded mode drops whole replica groups on a mesh
            self.degraded.mesh = r.reports[rank].mesh
        for slot in self.holders.of(rank):  # their state is the holder's own
            if slot not in r.replace:
                r.reports[slot] = with_fields(r.reports[rank], rank=slot)
                r.report_times[slot] = now

    def advance(self, now: float, wall: float | None = None) -> None:
        r = self.round
        if r is None and self.holders.degraded and self.first_steps.round is None and wall is not None:
            self.grow(now, wall)
            return
        if r is None or r.phase != "collect":
            return
        ranks, nproc = self.members.ranks, self.cfg.nproc
        done = sorted(k for k, m in ranks.items() if m.done)
        if done:
            # Some rank has left its loop: no step is left to recover into, and a rank lost or
            # caught by this round cannot be rebuilt from peers that have left (rules/after_loop.py)
            caught = sorted(k for k in r.reports if not ranks[k].done)
            unfinished = sorted(set(ranks) - set(done))
            waited = now - r.started
            why = after_the_loop(
                done, sorted(r.replace), caught, unfinished, r.target, waited, self.cfg.recovery_timeout
            )
            if why is not None:
                raise NotRecoverableError(why)
            return
        if r.replace:
            self.replace_ranks(r, sorted(r.replace), now)
            return
        if len(r.reports) < nproc:
            missing = waiting(ranks, r.reports, nproc)
            if late := overdue(missing, r.started, now, self.cfg.recovery_timeout, self.cfg.start_timeout):
                raise NotRecoverableError(
                    f"generation {r.target}: ranks {late} never reported within --recovery-timeout"
                )
            return
        rootless = self.rendezvous["kind"] == "rootless"
        if rootless and (unknown := [k for k in range(nproc) if not ranks[k].store_address]):
            # A rank's hello and its agent's ProcStarted (which names its key server) come over
            # two connections: on a busy host the hello can come first, and a plan sent then
            # would give its peers an empty address to rendezvous with. It comes in milliseconds.
            if now - r.started > self.cfg.recovery_timeout:
                raise NotRecoverableError(
                    f"generation {r.target}: no key-server address for ranks {unknown} within "
                    "--recovery-timeout (their agents never reported them started)"
                )
            return
        reports = [r.reports[k] for k in sorted(r.reports)]
        plan = self.ledger.plan(reports, r.initial, self.generation)
        closed = list(closed_sections(reports, plan.target_step))  # a section some rank passed
        plan = fold_held_slots(plan, {slot: holder for slot, holder in self.holders.pairs()})
        if self.ledger.settle(plan.target_step, r, reports, self.generation):
            self.replace_ranks(r, sorted(r.replace), now)  # fresh processes first (rules/respawn.py)
            return
        self.ledger.sections_in_doubt(plan.target_step, reports, closed, r.lost_with_host)
        plan_json = plan.to_json()
        # one Recover for every member, and of a size that does not grow with the job: the plan's
        # rank lists as ranges (the codec compacts them), the peer table as a delta (peer_table.py).
        # A member that does not hold the version the delta applies to gets the full table first,
        # in chunks.
        t = self.tables.for_plan(ranks, nproc) if rootless else self.tables.without_table(ranks)
        resume = with_fields(resume_plan(plan, self.holders.pairs()), sections_closed=closed)
        msg = recover_message(r.target, self.rendezvous, resume, t)
        for m in unique(ranks.values()):  # after every host's copy: a remote agent gets it first
            self.outbox.send(m, msg)
        r.phase = "rebuild"
        r.plan_sent = now
        # whole tables this round sent to hosts' agents and to single members (protocol/tables.py)
        tables = {"hosts": t.host_tables, "members": t.member_tables}
        held = {"holders": self.holders.pairs()} if self.holders.degraded else {}
        closing = {"sections_closed": closed} if closed else {}
        self.outbox.emit("plan", generation=r.target, peer_tables=tables, **plan_json, **held, **closing)

    def replace_ranks(self, r: Round, ranks: list[int], now: float) -> None:
        ms, out = self.members, self.outbox
        # a spare being stopped (retired: SparePool.retire_squeezed) is neither offered nor awaited
        spares = [m for m in ms.idle_spares() if m.killed_for is None]
        # and one on a host the health gate holds back (coordinator/health.py) takes no rank
        pool = [
            (m.worker_id, m.host)
            for m in spares
            if m.ready and m.connected and self.spares.promotable(m, now)
        ]
        live = ms.live_hosts()
        holding = {m.host for m in ms.ranks.values() if m.host in live}
        old_host = {rank: ms.ranks[rank].host if rank in ms.ranks else -1 for rank in ranks}
        match = match_spares([(rank, old_host[rank]) for rank in ranks], pool, holding, r.moving)
        grew = False
        unmatched = [rank for rank in ranks if rank not in match]
        # a starting spare counts as on its way only to a rank it could take: one beside other
        # ranks takes only its own host's rank (match_spares), so it never serves a lost host's
        starting = [m.host for m in spares if not m.ready and not self.spares.quarantined(m.host)]
        bare = without_spare([(rank, old_host[rank]) for rank in unmatched], starting, holding, r.moving)
        if r.waiting_since is None:
            r.waiting_since = now
        coming = len(unmatched) - len(bare)
        d = self.degraded.decide(r, ranks, len(match), coming, now)
        if d.action == WidthAction.FAIL:
            raise NotRecoverableError(d.reason)
        out.condition(
            "spare_wait",
            bool(unmatched),
            f"no hot spare ready for rank(s) {unmatched}; starting spares (waits up to {self.cfg.spare_wait:.0f} s)",
        )
        for rank in bare[: d.spawn]:
            # a rank whose host lives gets its spare there (its device is free); a lost host's rank
            # needs a spare host, and a spare squeezed onto another rank host could not take it
            host = old_host[rank]
            if host in live:
                self.spares.spawn(now, host=host)
            elif (to := move_chain(host, r.moving)[-1]) in live:
                # the rest of a lost host's ranks follow the first to its spare host (the newest one
                # they moved to, if that spare host was lost in turn)
                self.spares.spawn(now, host=to)
            else:
                self.spares.spawn(now, strict=True)
        if d.action == WidthAction.WAIT and not match:
            return
        for rank in sorted(match):
            spare = ms.procs[match[rank]]
            old = ms.ranks.get(rank)
            if rank in self.holders.held:
                self.holders.release(rank)  # growing back: its holder lives on, as itself
                grew = True
            elif old is not None:
                out.kill(old, old.killed_for or "replaced")
            ms.ranks[rank] = spare
            # the lost host its peers are to follow it from: the last of its moves so far
            if (lost := move_chain(old_host[rank], r.moving)[-1]) not in live:
                r.moving.setdefault(lost, spare.host)
            self.assign(spare, rank, r.target, now, initial=r.initial)
            r.replace.discard(rank)  # settled once the spare reports; re-added if it dies first
            out.emit("spare_assigned", rank=rank, worker=spare.worker_id, generation=r.target)
            out.log("info", f"spare {spare.worker_id} takes rank {rank}")
        if match:
            self.spares.refill(now)  # refill the pool in the background (once: it walks every rank)
        if d.action == WidthAction.SHRINK:
            self.degraded.shrink(r, sorted(r.replace), now)
        elif grew and not self.holders.degraded:
            nproc = self.cfg.nproc
            self.outbox.emit("width", generation=r.target, width=nproc, slots=nproc, holders=[])
            self.outbox.condition("degraded", False)
        if not r.replace:
            out.condition("spare_wait", False)
        r.waiting_since = None

    def on_recovered(self, m: Member, msg: Recovered, now: float) -> None:
        r = self.round
        if r is None or r.phase != "rebuild" or msg.generation != r.target or m.rank is None:
            return
        r.recovered[m.rank] = {**msg.timings, "time": now}
        for slot in self.holders.of(m.rank):
            r.recovered[slot] = r.recovered[m.rank]
        m.joined = True
        self.ledger.joined(m.rank)
        if len(r.recovered) < self.cfg.nproc:
            return
        self.generation = r.target
        self.round = None
        for member in self.members.ranks.values():
            member.last_progress = now  # the hang clock restarts with the new generation
        if r.initial:
            # a fault before every rank had formed the first generation is absorbed by start-up (no
            # recovery event: there was no step to lose); it is still named, so that every fault in
            # the job's account has a home
            causes = [{"rank": f["rank"], "kind": f["kind"], "detail": f["detail"]} for f in r.faults]
            during = f" through {len(causes)} fault(s) during start-up" if causes else ""
            self.ledger.startup_faults = len(causes)
            self.outbox.log(
                "info", f"generation {r.target} formed in {now - r.started:.2f} s after launch{during}"
            )
            self.outbox.emit("started", generation=r.target, seconds=now - r.started, faults=causes)
            self.refill_after_round = False
            self.spares.refill(now)
            return
        if self.refill_after_round:
            self.refill_after_round = False
            self.spares.refill(now)
        if self.spares.moving:
            self.spares.retire_squeezed()  # spares moved to a joined host that became ready during the round
        self.first_steps.wait_for(r)

    def on_committed(self, m: Member, msg: Committed, now: float) -> None:
        # spares page in room for the state (state/arena.py), and warm up once (recovery/warm_specs.py)
        grown, warm = (msg.state_bytes or 0) > self.state_bytes, msg.warm if self.warm is None else None
        self.state_bytes, self.warm = max(self.state_bytes, msg.state_bytes or 0), self.warm or warm
        if grown or warm is not None:
            for spare in (s for s in self.members.idle_spares() if s.ready):
                self.outbox.send(spare, Prepare(self.state_bytes, warm))
        if self.first_steps.round is None or m.rank is None or msg.generation != self.generation:
            return
        self.first_steps.committed([m.rank, *self.holders.of(m.rank)], now, msg.first_batch_s)

    # -- degraded mode (issue 39): DegradedMode decides and shrinks, the grow round is ours ------
    def grow(self, now: float, wall: float) -> None:
        """Degraded, between rounds, with spares ready: a round in which they take held slots
        back (the job aborts its step, the spares receive state, the step is replayed)."""
        back = self.degraded.slots_to_grow(now)
        if back is None:
            return
        slots, step = back
        for slot in slots:
            holder = self.holders.holder(slot)
            record = {
                "time": wall,
                "rank": slot,
                "kind": "grow",
                "detail": f"a spare takes slot {slot} back from rank {holder}",
                "step": step,
                "detected": now,
            }
            self.outbox.emit("grow", rank=slot, holder=holder, generation=self.generation, step=step)
            r = self.round if self.round is not None else self.begin(record, now)
            if r.faults[-1] is not record:
                r.faults.append(record)
            r.replace.add(slot)
            r.reports.pop(slot, None)

    def on_spare_ready(self, m: Member) -> None:
        """A spare finished warming up: room for the state, and maybe it stands in for another."""
        if self.state_bytes or self.warm is not None:
            self.outbox.send(m, Prepare(self.state_bytes, self.warm))
        if self.round is None and m.worker_id in self.spares.moving:
            self.spares.retire_squeezed()
