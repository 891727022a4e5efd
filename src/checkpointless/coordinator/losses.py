"""Losses, as the coordinator meets them: a process that exited, a spare lost, a host lost, and
hangs judged from the heartbeats. Each becomes a fault in the ledger and a round that handles it
(:class:`~checkpointless.coordinator.rounds.Rounds`); the hang rules themselves are the pure
functions of ``rules/hangs.py`` and ``rules/budget.py``.
"""

from __future__ import annotations

from checkpointless.coordinator.ledger import FaultLedger
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rounds import Rounds
from checkpointless.coordinator.rules.budget import first_step_limit, progress_limit
from checkpointless.coordinator.rules.fatal import exit_verdict
from checkpointless.coordinator.rules.fault_step import fault_step
from checkpointless.coordinator.rules.hangs import WorkerHealth, find_hung
from checkpointless.coordinator.spares import SparePool
from checkpointless.coordinator.state import RETIRED, Member
from checkpointless.coordinator.tables import TableDelivery
from checkpointless.errors import NotRecoverableError
from checkpointless.settings import JobSettings as LaunchConfig

__all__ = ["Losses"]


class Losses:
    def __init__(
        self,
        cfg: LaunchConfig,
        members: Members,
        outbox: Outbox,
        ledger: FaultLedger,
        spares: SparePool,
        tables: TableDelivery,
        rounds: Rounds,
    ) -> None:
        self.cfg = cfg
        self.members = members
        self.outbox = outbox
        self.ledger = ledger
        self.spares = spares
        self.tables = tables
        self.rounds = rounds

    def process_exited(
        self, worker_id: int, code: int, own_failure: bool, detail: str, tail: str, now: float, wall: float
    ) -> None:
        ms = self.members
        m = ms.procs.pop(worker_id, None)
        if m is None:
            return
        m.exited = True
        m.exit_code = code
        self.tables.forget(worker_id)
        m.connected = False
        if not m.done:  # a finished rank's exit status is the script's own business (see below)
            who = f"rank {m.rank}" if m.rank is not None else f"{m.role} {m.worker_id}"
            why = exit_verdict(who, code, m.greeted, m.killed_for is not None, self.cfg.script)
            if why is not None:  # a ConfigError, or a script that never adopted: no spare can help
                raise NotRecoverableError(why)
        if m.rank is None or ms.ranks.get(m.rank) is not m:
            if m.role == "spare":
                self.spare_lost(m, code, own_failure, detail, tail, now)
            return
        if m.done:
            if code != 0:  # its work was complete: the final barrier had passed everywhere
                self.outbox.log("warning", f"rank {m.rank} exited with code {code} after finishing")
            return
        if m.killed_for is not None:
            kind = "hang"
        elif code < 0:
            kind = "killed"
        else:
            kind = "exit"
        if not m.joined and own_failure:
            self.ledger.start_failed(m.rank, detail, tail)
        # it could not say where it was: its injected fault's step, or its last heartbeat's
        step = fault_step(None, m.announced_step, m.step)
        self.rounds.record_fault(m.rank, kind, detail, True, now, wall, step=step)

    def spare_lost(self, m: Member, code: int, own_failure: bool, detail: str, tail: str, now: float) -> None:
        self.outbox.emit("spare_lost", worker=m.worker_id, code=code)
        self.spares.moving.discard(m.worker_id)
        retired = m.killed_for == RETIRED
        # a spare we stopped did not fail to start
        self.ledger.spare_exited(m.ready, not m.ready and own_failure and not retired, detail, tail)
        if not retired:
            self.outbox.log("warning", f"spare {m.worker_id} exited (code {code}); starting another")
        self.spares.refill(now)

    def host_lost(self, host: int, why: str, now: float, wall: float) -> None:
        ms = self.members
        h = ms.hosts.get(host)
        if h is None or h.lost:
            return
        h.lost = True
        lost = sorted(wid for wid, m in ms.procs.items() if m.host == host)
        ranks = sorted(m.rank for m in ms.procs.values() if m.host == host and m.rank is not None)
        self.outbox.emit("host_lost", host=host, address=h.address, why=why, ranks=ranks, processes=len(lost))
        self.outbox.log(
            "warning", f"host {h.address} (agent {host}) lost: {why}; ranks {ranks} move to spares"
        )
        for wid in lost:
            self.process_exited(wid, -9, False, f"host {h.address} lost: {why}", "", now, wall)
        if self.rounds.round is not None:  # the exits above start one, or join the one running
            self.rounds.round.lost_with_host.update(ranks)

    def check_hangs(self, now: float, wall: float) -> None:
        ranks, out, cfg = self.members.ranks, self.outbox, self.cfg
        if any(m.killed_for and not m.exited for m in ranks.values()):
            return  # a culprit is being killed: its exit starts the round; judge nobody meanwhile
        r = self.rounds.round
        health = []
        for rank, m in ranks.items():
            if m.exited or m.killed_for is not None or not m.connected:
                continue  # a process still starting is judged from the process table (the agent)
            # a rank past its loop (Done) makes no step progress by design: its script may save or
            # evaluate for a long time before it leaves; only its silence (a stopped process) counts
            judged = m.progress_known and r is None and not m.done
            progress = m.last_progress if judged else now
            # no step time yet: this process has not finished a step (its first may be compiling)
            health.append(WorkerHealth(rank, m.last_message, progress, m.in_collective, m.step_time is None))
        times = [m.step_time for m in ranks.values() if m.step_time is not None]
        limit = progress_limit(cfg.hang_timeout, cfg.hang_factor, times)
        first = first_step_limit(limit, cfg.first_step_timeout)
        if r is not None and r.phase == "collect" and not r.initial:
            # a member that keeps its heartbeat but never leaves its step after the abort (a busy
            # loop) holds the round up: it is hung like a process that stopped
            for rank, m in ranks.items():
                waiting = rank not in r.reports and rank not in r.replace and m.connected and not m.done
                # A spare given the rank this round reports only once it reaches job.steps(): it
                # first runs the script's set-up after init() (the model to its device, fully_shard,
                # the optimizer, the data loader), which has the first step's allowance, not the
                # step-time limit. A stopped one is still caught by its silence.
                allowed = limit if m.joined else first
                if waiting and now - max(r.abort_sent, m.assigned_at) > allowed:
                    what = "leave its step" if m.joined else "report after it was given its rank"
                    why = f"did not {what} within {allowed:.1f} s of the abort"
                    out.log("warning", f"rank {rank} {why}; killing it")
                    out.kill(m, why)
                    return
        culprits, why = find_hung(health, now, cfg.hang_timeout, limit, first)
        if not culprits and why and r is None:
            # everyone waits for everyone (a lost message, a wedged link): nobody to replace,
            # but the collective will never finish; rebuild the communicator with the same ranks
            self.rounds.record_fault(min(h.rank for h in health), "stall", why, False, now, wall)
            return
        for rank in culprits:
            out.log("warning", f"rank {rank} is hung: {why}; killing it")
            out.kill(ranks[rank], why)
