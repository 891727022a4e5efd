"""The fault budget and the no-progress limits, as pure functions: a situation in, a verdict out.

* :func:`budget_verdict` is the fault budget: the same rank, or the same cause, failing again and
  again across steps ends the job instead of spinning through recoveries;
* :func:`start_failure_verdict` ends respawn loops: a rank whose replacements keep dying before
  they join;
* :func:`progress_limit` scales the no-progress limit with the job's own measured step time, and
  :func:`first_step_limit` gives a process's first step its own allowance.

Each is unit-tested by feeding it a situation (tests/unit/coordinator/test_policy.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FaultRecord",
    "budget_verdict",
    "first_step_limit",
    "progress_limit",
    "start_failure_verdict",
]


def progress_limit(hang_timeout: float, hang_factor: float, step_times: Sequence[float]) -> float:
    """How long a rank may go without step progress before it counts as hung.

    A step may legitimately be slow (a big model, a busy machine, a compiled first step): the
    limit grows with the step times the ranks report, so only a step far slower than this job's
    own steps is a hang, and never sooner than the fixed timeout.
    """
    return max(hang_timeout, hang_factor * max(step_times, default=0.0))


def first_step_limit(progress_limit: float, first_step_timeout: float) -> float:
    """The no-progress limit for a process's first step: at the job's start and for a replacement
    after a recovery. That step may compile the model (``torch.compile`` takes minutes on a big
    one) and there is no measured step time yet to scale from, so it gets its own allowance,
    never shorter than the ordinary limit."""
    return max(progress_limit, first_step_timeout)


@dataclass(frozen=True)
class FaultRecord:
    """One fault as the budget sees it."""

    rank: int
    kind: str  # exception, killed, exit, hang, comm, stall, recovery, start
    step: int | None
    cause: str  # the error text or the detail of the fault


# Symptoms, not causes: a rank whose collective failed because a peer died, a rebuild that a
# newer fault interrupted. They follow a real fault and must not use up its rank's budget.
_SYMPTOMS = frozenset({"comm", "stall", "recovery"})


def _signature(cause: str) -> str:
    """The cause with the details that change from step to step (numbers, addresses) removed."""
    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "#", cause.lower())[:200]


def budget_verdict(history: Sequence[FaultRecord], window: int, max_repeats: int) -> str | None:
    """Whether the newest fault exhausts the fault budget; the reason, or None.

    The same rank failing with the same kind of fault more than ``max_repeats`` times within
    ``window`` steps is not bad luck: it is a bug that a replacement will hit again, or a bad
    device. The same cause (an exception with the same message) on any ranks likewise. Faults at
    one step are also capped elsewhere (``--max-step-failures``); this catches a fault that moves
    on with the steps, which that rule cannot see.
    """
    if not history:
        return None
    last = history[-1]
    if last.kind in _SYMPTOMS or last.step is None:
        return None

    def near(f: FaultRecord) -> bool:
        return f.step is not None and last.step is not None and abs(last.step - f.step) <= window

    same_rank = [f for f in history if f.rank == last.rank and f.kind == last.kind and near(f)]
    if len(same_rank) > max_repeats:
        steps = ", ".join(str(f.step) for f in same_rank)
        return (
            f"rank {last.rank} failed {len(same_rank)} times with {last.kind} within {window} steps "
            f"(steps {steps}); last: {last.cause}. This recurs, so it is not a transient fault: fix "
            f"the cause, or allow more with --max-repeat-faults / --fault-window"
        )
    if last.kind == "exception":
        sig = _signature(last.cause)
        same_cause = [f for f in history if f.kind == "exception" and near(f) and _signature(f.cause) == sig]
        if len(same_cause) > max_repeats:
            ranks = sorted({f.rank for f in same_cause})
            return (
                f"the same exception was raised {len(same_cause)} times within {window} steps on "
                f"rank(s) {ranks}: {last.cause}. This recurs, so it is not a transient fault: fix the "
                f"cause, or allow more with --max-repeat-faults / --fault-window"
            )
    return None


def start_failure_verdict(rank: int, failures: int, limit: int, last_cause: str, log_tail: str) -> str | None:
    """Ends a respawn loop: ``failures`` processes in a row taking ``rank`` died before joining."""
    if failures < limit:
        return None
    tail = f"\nits last output:\n{log_tail}" if log_tail else ""
    return (
        f"rank {rank} could not be started: {failures} processes in a row died before joining "
        f"the job (last: {last_cause}). Fix what the output below shows; a replacement would fail "
        f"the same way{tail}"
    )
