"""Fresh-process retries, as pure functions: what the job does once a step's in-process retries
are used up.

A rank that raises stays in its process and the step is retried there (``replace=False``), up to
the fault budget (:mod:`.budget`) and the no-progress limit (``--max-step-failures``). Some faults
live in the process itself: a wedged device context, leaked handles or file descriptors, a
corrupted allocator, a half-done import. Every in-process retry meets them again, and a fresh
process does not. A bug in the script (or its data) at that step raises in a fresh process too.

So when those limits are reached for an exception, the raising ranks are replaced by fresh
processes, as a killed rank is, and the step is tried once more (``--fresh-process-retries``
bounds how often within ``--fault-window`` steps). If it raises again there, the job ends, saying so.

* :func:`respawn_decision`: at a round's plan, with the coordinator's limit reached, the ranks to
  replace, or the reason the job ends (off, used up, no state left for the fresh processes);
* :func:`retries_spent_verdict`: a worker's own limit (``init(max_step_retries=)``) reached: its
  process ends, and whether a fresh process may take the rank;
* :func:`no_state_left`: the plan found no state for the fresh processes: the job's end;
* :func:`fresh_failure`: a fault that shows a fresh process did not cure a recurrence, and the
  job's end it calls for.

Unit-tested by feeding them situations (tests/unit/coordinator/test_respawn_rules.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from checkpointless.coordinator.rules.budget import FaultRecord
from checkpointless.coordinator.rules.decisions import MemberReport, plan_recovery
from checkpointless.errors import NotRecoverableError

__all__ = [
    "Respawn",
    "fresh_failure",
    "in_process_tries",
    "no_state_left",
    "respawn_decision",
    "retries_spent_verdict",
    "used",
]

SETTING = "--fresh-process-retries"


@dataclass(frozen=True)
class Respawn:
    """Ranks replaced by fresh processes once their in-process retries of ``step`` were used up."""

    ranks: tuple[int, ...]
    step: int
    generation: int  # the newest formed generation when they were replaced
    retries: int  # the in-process retries the step had had
    cause: str = ""  # the last in-process error


def used(respawns: Sequence[Respawn], step: int | None = None, window: int = 0) -> int:
    """Fresh-process retries the job has had within ``window`` steps of ``step`` (all of them when
    ``step`` is unknown): ranks replaced for one step in one round count once.

    A window, as the fault budget counts, not the whole job: at scale a long job meets many
    unrelated faults that live in a process (Llama 3's 54 days on 16,384 GPUs, ~30 recurring
    software faults a run in docs/goodput.md's model), and a count over the whole job would stop
    it at the N+1th though each was cured. A fault that a fresh process does not cure is stopped by
    :func:`fresh_failure`, whatever the count."""
    near = [x for x in respawns if step is None or abs(x.step - step) <= window]
    return len({(x.step, x.generation) for x in near})


def in_process_tries(history: Sequence[FaultRecord], ranks: Sequence[int], step: int, window: int) -> int:
    """How many times ``ranks`` raised at ``step`` in their processes: the first try and its
    retries. A fault that moved on with the steps (one raise at ``step``) counts its raises within
    ``window`` steps, as the budget counted them."""
    mine = [f for f in history if f.kind == "exception" and f.rank in ranks and f.step is not None]
    here = sum(1 for f in mine if f.step == step)
    if here > 1:
        return here
    return sum(1 for f in mine if f.step is not None and abs(f.step - step) <= window)


def respawn_decision(
    why: str,
    raised: Collection[int],
    reports: Sequence[MemberReport],
    allowed: int,
    had: int,
    initial: bool = False,
) -> tuple[int, ...] | str:
    """With a step's in-process retries used up (``why``: the budget's or the no-progress rule's
    verdict), the ranks to replace with fresh processes, or the reason the job ends.

    ``raised``: the ranks whose own exception this round saw; ``reports``: every
    member's report of where it stopped; ``allowed``: ``--fresh-process-retries``; ``had``: how
    many the job has had (:func:`used`); ``initial``: the job's first generation is forming. A
    verdict on kills, exits or hangs alone (nothing ``raised``) ends the job: those ranks already ran in fresh processes. Fresh processes start without state, so they
    are tried only where the plan would still find it: a rank that is not replaced, a snapshot or
    a checkpoint (a fresh process sees the same ones on its host).
    """
    if (spent := _spent(why, allowed, had)) is not None:
        return spent
    if not raised:
        return why
    ranks = tuple(sorted(raised))
    fresh = [
        replace(r, committed_step=-1, valid=False, copies=()) if r.rank in raised else r for r in reports
    ]
    try:
        plan_recovery(fresh, initial=initial)
    except NotRecoverableError as e:
        return (
            f"{why}. Fresh processes for rank(s) {list(ranks)} were not tried: nothing would be left "
            f"to start them from ({e})"
        )
    return ranks


def fresh_failure(
    last: FaultRecord, generation: int, verdict: str | None, respawns: Sequence[Respawn], window: int
) -> str | None:
    """Whether ``last`` (a fault seen while ``generation`` was the newest formed one) shows that a
    fresh process did not cure a recurrence; the job's end, or None.

    It does when a replaced rank's exception comes back at the step it was replaced for, in a
    later generation than the replacement (one raised in the same round is the replacement's
    reason, not its result), or when the fault budget fires again (``verdict``) on that rank
    within ``window`` steps of it: a fault that moves on with the steps. Only a replaced rank's
    fault says so: when every rank raises at one step, a rank still in its own process may raise
    again after its peers were replaced, and that is its own in-process retry, not a fresh
    process failing (it is replaced in turn, or the job ends for want of state)."""
    if last.kind != "exception" or last.step is None:
        return None
    for x in reversed(respawns):
        if generation <= x.generation or last.rank not in x.ranks:
            continue
        if last.step == x.step or (verdict is not None and abs(last.step - x.step) <= window):
            return (
                f"rank {last.rank} raised at step {last.step} again in a fresh process: {last.cause}. "
                f"The step was retried in process {x.retries} times and once in a fresh process "
                f"(rank(s) {list(x.ranks)} replaced at step {x.step}), so it is not a transient fault "
                "and not one that lives in a process (a wedged device, leaked handles): it is a bug "
                "in the script or its data at this step. Fix the cause; the rank's traceback is in "
                "its log (<run dir>/logs)"
            )
    return None


def _spent(why: str, allowed: int, had: int) -> str | None:
    if allowed <= 0:
        return why
    if had >= allowed:
        return (
            f"{why} (the {allowed} fresh-process retries allowed within --fault-window steps are used "
            f"up: raise {SETTING} to allow more)"
        )
    return None


def retries_spent_verdict(error: str, step: int | None, allowed: int, had: int) -> str | None:
    """A worker reached its own in-process limit at ``step`` (``error``: what it said) and its
    process ends: None when a fresh process takes the rank (the exit is replaced as any exit is),
    else the job's end (off, used up, or the step unknown)."""
    if step is None:
        return error
    return _spent(error, allowed, had)


def no_state_left(plan_error: str, pending: Sequence[Respawn]) -> str:
    """The plan found no state to start from while ``pending`` ranks were being tried in fresh
    processes (every rank used up its retries): the job's end, naming both."""
    ranks = sorted({k for x in pending for k in x.ranks})
    step = pending[-1].step
    return (
        f"rank(s) {ranks} used up their in-process retries of step {step} ({pending[-1].cause}); "
        f"fresh processes could not be tried, since no rank, snapshot or checkpoint is left to start "
        f"them from: {plan_error}"
    )
