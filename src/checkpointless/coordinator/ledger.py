"""The fault ledger: every fault the job has met, the budgets they are counted against, the
injected faults that fired, and each recovery's report.

It decides, through the pure rules of ``rules/budget.py``, when faults no longer look transient:
a verdict raises :class:`~checkpointless.errors.NotRecoverableError`, which ends the job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from checkpointless.coordinator.downtime import recovery_fields
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rules.budget import FaultRecord, budget_verdict, start_failure_verdict
from checkpointless.coordinator.state import Round
from checkpointless.errors import NotRecoverableError
from checkpointless.settings import JobSettings as LaunchConfig

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

    def resumed_inexact(self, rank: int | None, step: int, what: str, detail: str) -> None:
        """A rank resumed without its own ``what``: an event now, and a line in the job's end."""
        entry = InexactResume(rank, step, what, detail)
        self.inexact.append(entry)
        self.outbox.emit("inexact", **asdict(entry))
        self.outbox.log("warning", f"rank {rank} resumed step {step} without its own {what}: {detail}")

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

    def record(self, rank: int, kind: str, step: int | None, detail: str) -> None:
        """Count a fault against the budget; raises once the budget is spent."""
        self.history.append(FaultRecord(rank, kind, step, detail))
        why = budget_verdict(self.history, self.cfg.fault_window, self.cfg.max_repeat_faults)
        if why is not None:
            raise NotRecoverableError(why)

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

    def check_progress(self, target_step: int, faults: list[dict[str, Any]], initial: bool) -> None:
        """A plan to restore ``target_step`` is about to go out for a round of ``faults``.

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
            raise NotRecoverableError(
                f"faults keep recurring at step {target_step}: {self.same_target} recoveries in a "
                "row made no progress; this looks like a bug or a bad node, not a transient fault "
                "(raise --max-step-failures to allow more)"
            )

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
