"""The fault ledger: every fault the job has met, the budgets they are counted against, the
injected faults that fired, and each recovery's report.

It decides, through the pure rules of ``rules/budget.py``, when faults no longer look transient:
a verdict raises :class:`~checkpointless.errors.NotRecoverableError`, which ends the job. A
verdict on an exception is held until the round's plan instead, where ``rules/respawn.py`` may
try the step once more in fresh processes (``--fresh-process-retries``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from checkpointless.coordinator.downtime import recovery_fields
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rules.budget import FaultRecord, budget_verdict, start_failure_verdict
from checkpointless.coordinator.rules.decisions import MemberReport, RecoveryPlan, plan_recovery
from checkpointless.coordinator.rules.respawn import (
    Respawn,
    fresh_failure,
    in_process_tries,
    no_state_left,
    respawn_decision,
    retries_spent_verdict,
    used,
)
from checkpointless.coordinator.rules.sections import doubtful_sections, unheard_ranks
from checkpointless.coordinator.state import Round
from checkpointless.errors import NotRecoverableError
from checkpointless.settings import JobSettings as LaunchConfig
from checkpointless.state.buddy_ring import buddy_of

__all__ = ["FaultLedger", "InexactResume"]


@dataclass(frozen=True)
class InexactResume:
    """A rank that resumed ``step`` without some of its own per-rank state (``what``): the job
    went on, but may differ from the run without the fault (protocol ``Inexact``)."""

    rank: int | None
    step: int
    what: str
    detail: str


class FaultLedger:
    def __init__(self, cfg: LaunchConfig, outbox: Outbox) -> None:
        self.cfg = cfg
        self.outbox = outbox
        self.history: list[FaultRecord] = []
        # rank -> the step of its newest raise: from a fault of its own, or from its report to a
        # round already under way (which is no fault record of its own: the round covers it)
        self.last_raised: dict[int, int] = {}
        # rank -> (step, its raises there in a row that rounds heard): a raise reported only to a
        # round begun by another rank's fault is in no fault record, but it was a try all the same
        self.streak: dict[int, tuple[int, int]] = {}
        self.start_failures: dict[int, int] = {}  # rank -> its processes in a row that died before joining
        self.early_spare_deaths = 0  # spares in a row that died before they were ready
        self.fired: set[str] = set()  # injected faults that have fired (ids)
        self.fired_at: float | None = None  # wall time the last injected fault fired
        self.recoveries: list[dict[str, Any]] = []
        self.startup_faults = 0  # faults absorbed before the first generation formed
        # recurring recoveries to one step (--max-step-failures)
        self.last_target: int | None = None
        self.same_target = 0
        self.last_reached = -1  # the latest step a fault has come from
        self.inexact: list[InexactResume] = []  # resumes that may differ: in job_end's account
        self.held: str | None = None  # an exception's budget verdict, held for the round's plan
        self.respawns: list[Respawn] = []  # steps tried again in fresh processes (rules/respawn.py)

    def resumed_inexact(self, rank: int | None, step: int, what: str, detail: str) -> None:
        """A rank resumed without its own ``what``: an event now, and a line in the job's end."""
        entry = InexactResume(rank, step, what, detail)
        self.inexact.append(entry)
        self.outbox.emit("inexact", **asdict(entry))
        self.outbox.log("warning", f"rank {rank} resumed step {step} without its own {what}: {detail}")

    def sections_in_doubt(
        self, step: int, reports: list[MemberReport], closed: list[str], lost_with_host: set[int]
    ) -> None:
        """Sections redone at the boundary after ``step`` steps that a lost rank may have passed
        (rules/sections.py ``doubtful_sections``, ``lost_with_host``: the ranks of the round lost
        with their host): an ``inexact`` event naming each, a warning, and a line in the job's
        end. The weights are not in doubt, only the section's output."""
        cfg = self.cfg
        unheard = unheard_ranks(lost_with_host, reports, lambda rank: buddy_of(rank, cfg.nproc, cfg.per_node))
        for name, ranks in doubtful_sections(reports, step, closed, unheard).items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"
            detail = (
                f"section {name!r} at the boundary after step {step}: {who} was lost in its closing "
                "barrier (or with its host and the keeper of its records, so nobody can say), before "
                "any live rank could learn whether it passed; no live "
                "rank passed it, so every rank redoes it (the ranks agree, the weights are exact), "
                "but what the lost rank did past the barrier (lines it showed, a tracker record, a "
                "file) may appear twice: make the section's output idempotent (docs/fault-model.md)"
            )
            entry = InexactResume(ranks[0] if len(ranks) == 1 else None, step, "section", detail)
            self.inexact.append(entry)
            self.outbox.emit("inexact", **asdict(entry), section=name, ranks=list(ranks))
            self.outbox.log("warning", detail)

    def replay_differed(
        self, rank: int | None, step: int, generation: int, interrupted: str, replayed: str
    ) -> None:
        """A rank's first replay of ``step`` recorded another loss than the attempt a fault
        interrupted: a ``replay_differs`` event now, and a line in the job's end (as an inexact
        resume, ``what`` "replay": the result may differ from the run without the fault)."""
        detail = (
            f"step {step} replayed to loss {replayed}, its interrupted attempt had {interrupted}: "
            "something in the step is not a function of its state and its step (a data order, a "
            "generator, a kernel); `checkpointless audit` names the cause"
        )
        self.inexact.append(InexactResume(rank, step, "replay", detail))
        self.outbox.emit(
            "replay_differs",
            rank=rank,
            step=step,
            generation=generation,
            interrupted=interrupted,
            replayed=replayed,
        )
        self.outbox.log("warning", f"rank {rank}: {detail}")

    def inexact_account(self) -> list[dict[str, Any]]:
        """Every inexact resume so far, for ``job_end``."""
        return [asdict(x) for x in self.inexact]

    def record(self, rank: int, kind: str, step: int | None, detail: str, generation: int = -1) -> None:
        """Count a fault (seen while ``generation`` was the newest formed) against the budget;
        raises once the budget is spent, unless a fresh process may still cure it (``held``)."""
        self.history.append(FaultRecord(rank, kind, step, detail))
        if kind == "exception" and step is not None:
            self.last_raised[rank] = step
        cfg = self.cfg
        why = budget_verdict(self.history, cfg.fault_window, cfg.max_repeat_faults)
        end = fresh_failure(self.history[-1], generation, why, self.respawns, cfg.fault_window)
        if end is not None:
            raise NotRecoverableError(end)
        if why is None:
            return
        if kind == "exception" and self._replacing(rank, step, generation):
            return  # its process's last raise, after its own limit already gave it a fresh one
        if kind == "exception" and used(self.respawns, step, cfg.fault_window) < cfg.fresh_process_retries:
            self.held = why  # the round's plan decides (settle): the other ranks report first
            return
        raise NotRecoverableError(why)

    def settle(
        self, target_step: int, r: Round, reports: list[MemberReport], generation: int
    ) -> tuple[int, ...]:
        """A plan to restore ``target_step`` is about to go out for round ``r``: the ranks to
        replace with fresh processes first (none: send it), or the job's end (raised).

        The limits are those of :meth:`record` and :meth:`check_progress`; once either is reached
        for ranks that raised, ``rules/respawn.py`` decides."""
        cfg = self.cfg
        for seen in r.raised.values():  # a fresh process's raise that came in as a report only
            if (end := fresh_failure(seen, generation, None, self.respawns, cfg.fault_window)) is not None:
                raise NotRecoverableError(end)
        stuck = self.check_progress(target_step, r.faults, r.initial)
        why, self.held = self.held or stuck, None
        if why is None:
            return ()
        step = max((f.step for f in r.raised.values() if f.step is not None), default=target_step)
        had = used(self.respawns, step, cfg.fault_window)
        d = respawn_decision(why, list(r.raised), reports, cfg.fresh_process_retries, had, r.initial)
        if isinstance(d, str):
            raise NotRecoverableError(d)
        retries = max(self._tries(d, step) - 1, 0)
        for rank in d:
            self.streak.pop(rank, None)  # the fresh processes' raises are a new series
        self.respawns.append(Respawn(d, step, generation, retries, why))
        self.last_target, self.same_target = None, 0  # the fresh processes' try is a new series
        for rank in d:  # replace_ranks kills each old process as its fresh one takes the rank
            r.replace.add(rank)
            r.reports.pop(rank, None)
            r.raised.pop(rank, None)
        self.outbox.emit("respawn", ranks=list(d), step=step, generation=generation, retries=retries)
        self.outbox.log(
            "warning",
            f"rank(s) {list(d)}: the in-process retries of step {step} are used up ({why}); "
            f"trying it once more in fresh processes ({had + 1} of {cfg.fresh_process_retries})",
        )
        return d

    def raised_in_round(self, rank: int, step: int | None) -> None:
        """``rank`` reported to the round under way that it raised at ``step``."""
        if step is not None:
            self.last_raised[rank] = step
            at, n = self.streak.get(rank, (step, 0))
            self.streak[rank] = (step, n + 1 if at == step else 1)

    def _tries(self, ranks: tuple[int, ...], step: int) -> int:
        """How often ``ranks`` raised at ``step`` in their processes, as far as the coordinator
        heard: its fault records, or its rounds' reports where those heard more."""
        heard = [n for k in ranks for at, n in [self.streak.get(k, (step, 0))] if at == step]
        return max(in_process_tries(self.history, ranks, step, self.cfg.fault_window), *heard, 0)

    def retries_spent(
        self, rank: int, beat_step: int | None, error: str, generation: int, tries: int = 0
    ) -> None:
        """``rank``'s worker reached its own in-process limit (``init(max_step_retries=)``) and
        its process ends (``error``: what it said; ``tries``: how often the step raised there, as
        the worker counted, 0 if it did not say): a fresh process takes the rank through that
        exit, as for any exit, or the job ends here (raised)."""
        cfg = self.cfg
        # its retries' step, as its newest raise named it: a raise reported only to a round is
        # in no fault record, and the history's last one may be a step long past
        step = self.last_raised.get(rank, beat_step)
        if self._replacing(rank, step, generation):
            return  # the round's plan already gave it a fresh process (settle): its exit is that
        episode = step is not None and any(
            x.step == step and x.generation == generation for x in self.respawns
        )
        had = 0 if episode else used(self.respawns, step, cfg.fault_window)  # one step and round: once
        why = retries_spent_verdict(f"rank {rank}: {error}", step, cfg.fresh_process_retries, had)
        if why is not None or step is None:
            raise NotRecoverableError(why or error)
        # the worker's own count, or what this coordinator heard and the last raise, sent only here
        tries = tries or self._tries((rank,), step) + 1
        self.streak.pop(rank, None)  # the fresh process's raises are a new series
        self.respawns.append(Respawn((rank,), step, generation, tries - 1, error))
        # A raise recorded just before this (the worker's last try) held the budget's verdict for
        # the round's plan (record); this respawn answers it. Left held, the plan that brings the
        # fresh process in would replace that process again before it ever tried the step (seen
        # in CI: a second spare started and the first one killed).
        self.held = None
        self.last_target, self.same_target = None, 0  # the fresh process's try is a new series
        self.outbox.emit("respawn", ranks=[rank], step=step, generation=generation, retries=tries - 1)
        self.outbox.log(
            "warning",
            f"rank {rank}: the in-process retries of step {step} are used up ({error}); its process "
            "ends and a fresh one tries the step once more",
        )

    def _replacing(self, rank: int, step: int | None, generation: int) -> bool:
        """Whether ``rank`` already has a fresh process coming for ``step``'s retries, granted
        while ``generation`` was the newest formed: its old process's raise or own-limit exit that
        comes after (the two race: a report to the round and a message of its own) is the same
        episode's, and must not replace the fresh process before it tried the step."""
        return any(rank in x.ranks and x.step == step and x.generation == generation for x in self.respawns)

    def plan(self, reports: list[MemberReport], initial: bool, generation: int) -> RecoveryPlan:
        """The round's plan (rules/decisions.py); with no state left while ranks were to be tried
        in fresh processes, the job's end names both."""
        try:
            return plan_recovery(reports, initial=initial)
        except NotRecoverableError as e:
            pending = [x for x in self.respawns if x.generation == generation]
            if not pending:
                raise
            raise NotRecoverableError(no_state_left(str(e), pending)) from None

    def start_failed(self, rank: int, detail: str, tail: str) -> None:
        """A process died before it ever joined as its rank: count it against a respawn loop."""
        n = self.start_failures.get(rank, 0) + 1
        self.start_failures[rank] = n
        why = start_failure_verdict(rank, n, self.cfg.max_start_failures, detail, tail)
        if why is not None:
            raise NotRecoverableError(why)

    def joined(self, rank: int) -> None:
        """A process formed a generation as ``rank``: its respawn count starts again."""
        self.start_failures.pop(rank, None)

    def spare_ready(self) -> None:
        self.early_spare_deaths = 0

    def spare_exited(self, ready: bool, failed_to_start: bool, detail: str, tail: str) -> None:
        """A spare exited; ``failed_to_start``: by its own failure before it was ready."""
        if failed_to_start:
            self.early_spare_deaths += 1
        elif ready:
            self.early_spare_deaths = 0
        if self.early_spare_deaths >= self.cfg.max_start_failures:
            raise NotRecoverableError(
                f"{self.early_spare_deaths} spare processes in a row failed before they were ready "
                f"(last: {detail}); the script fails before or inside checkpointless.init(), so every "
                "replacement would too. Fix what its output shows" + (f":\n{tail}" if tail else "")
            )

    def fault_fired(self, fault_id: str, wall: float) -> None:
        self.fired.add(fault_id)
        self.fired_at = wall

    def check_progress(self, target_step: int, faults: list[dict[str, Any]], initial: bool) -> str | None:
        """A plan to restore ``target_step`` is about to go out for a round of ``faults``: the
        no-progress verdict, or None.

        Every round counts, the start-up ones too: a recovery that fails the same way each time
        must end the job, not spin through generations. Progress is a fault at a later step than
        any before: a plan that restores the same older snapshot each time keeps its target while
        the job trains past it between faults, and that is no loop."""
        reached = max((f["step"] for f in faults if f.get("step") is not None), default=-1)
        stuck = target_step == self.last_target and reached <= self.last_reached
        self.same_target = self.same_target + 1 if stuck else 1
        self.last_target = target_step
        self.last_reached = max(self.last_reached, reached)
        if self.same_target > self.cfg.max_step_failures + (1 if initial else 0):
            return (
                f"faults keep recurring at step {target_step}: {self.same_target} recoveries in a "
                "row made no progress; this looks like a bug or a bad node, not a transient fault "
                "(raise --max-step-failures to allow more)"
            )
        return None

    def report_recovery(
        self,
        r: Round,
        first_step_done: float | None,
        first_batches: dict[int, float],
        incomplete: str | None = None,
    ) -> None:
        fields, summary, used_fired = recovery_fields(
            r, first_step_done, first_batches, self.fired_at, incomplete
        )
        if used_fired:
            self.fired_at = None
        self.outbox.emit("recovery", **fields)
        self.recoveries.append(fields)
        self.outbox.log("info", summary)
