"""Fresh-process retries (coordinator/rules/respawn.py): pure functions, situations in, verdicts out."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.coordinator.rules.budget import FaultRecord
from checkpointless.coordinator.rules.decisions import MemberReport
from checkpointless.coordinator.rules.respawn import (
    Respawn,
    fresh_failure,
    in_process_tries,
    no_state_left,
    respawn_decision,
    retries_spent_verdict,
    used,
)

pytestmark = pytest.mark.timeout(60)

WHY = "rank 1 failed 4 times with exception within 20 steps"


def report(
    rank: int, valid: bool = True, snapshot: int | None = None, ckpt: int | None = None
) -> MemberReport:
    return MemberReport(rank, 7 if valid else -1, valid, snapshot_step=snapshot, checkpoint_step=ckpt)


def test_the_raising_rank_is_replaced_while_a_survivor_holds_the_state() -> None:
    reports = [report(0), report(1, valid=False), report(2)]
    assert respawn_decision(WHY, [1], reports, allowed=16, had=0) == (1,)


def test_off_or_used_up_ends_the_job_with_the_budgets_reason() -> None:
    reports = [report(0), report(1)]
    assert respawn_decision(WHY, [1], reports, allowed=0, had=0) == WHY
    spent = respawn_decision(WHY, [1], reports, allowed=2, had=2)
    assert isinstance(spent, str) and spent.startswith(WHY)
    assert "2 fresh-process retries allowed within --fault-window steps are used up" in spent
    assert "--fresh-process-retries" in spent


def test_a_verdict_on_kills_alone_ends_the_job() -> None:
    # a killed, exited or hung rank already ran in a fresh process: nothing new to try
    assert respawn_decision(WHY, [], [report(0), report(1)], allowed=16, had=0) == WHY


def test_every_rank_raising_needs_a_snapshot_or_a_checkpoint() -> None:
    # a rank that raised before its update is still valid, but its process is replaced: its
    # state goes with it, so only a snapshot or a checkpoint can start the fresh processes
    bare = [report(0), report(1)]
    why = respawn_decision(WHY, [0, 1], bare, allowed=16, had=0)
    assert isinstance(why, str) and why.startswith(WHY)
    assert "Fresh processes for rank(s) [0, 1] were not tried" in why and "--snapshot-every" in why
    assert respawn_decision(WHY, [0, 1], [report(0, snapshot=5), report(1, snapshot=5)], 16, 0) == (0, 1)
    assert respawn_decision(WHY, [0, 1], [report(0, ckpt=4), report(1)], 16, 0) == (0, 1)


@settings(max_examples=300, deadline=None)
@given(
    nproc=st.integers(1, 5),
    data=st.data(),
    allowed=st.integers(0, 3),
    had=st.integers(0, 4),
    snapshot=st.booleans(),
)
def test_the_decision_against_its_definition(
    nproc: int, data: st.DataObject, allowed: int, had: int, snapshot: bool
) -> None:
    raised = data.draw(st.sets(st.integers(0, nproc - 1)))
    valid = data.draw(st.lists(st.booleans(), min_size=nproc, max_size=nproc))
    reports = [report(k, valid[k], snapshot=3 if snapshot else None) for k in range(nproc)]
    got = respawn_decision(WHY, sorted(raised), reports, allowed, had)
    state_left = snapshot or any(valid[k] for k in range(nproc) if k not in raised)
    if allowed > had and raised and state_left:
        assert got == tuple(sorted(raised))
    else:
        assert isinstance(got, str) and got.startswith(WHY)


RESPAWNED = Respawn(ranks=(1,), step=3, generation=4, retries=3, cause="ZeroDivisionError")


@pytest.mark.parametrize(
    "kind,step,generation,verdict,ends",
    [
        # the fresh process raises at the same step: the script's bug
        ("exception", 3, 5, None, True),
        ("exception", 3, 9, None, True),
        # raised in the round that replaced them: the reason for the replacement, not its result
        ("exception", 3, 4, None, False),
        # another step, and the budget quiet: a new fault
        ("exception", 4, 5, None, False),
        # another step within the window, the budget firing again: a fault that moves on
        ("exception", 9, 5, "budget", True),
        # ... but not once it is outside the window
        ("exception", 30, 5, "budget", False),
        # a kill, an exit or a hang at that step says nothing about the script
        ("killed", 3, 5, None, False),
        ("exit", 3, 5, "budget", False),
    ],
)
def test_a_fresh_process_that_raises_again_ends_the_job(
    kind: str, step: int, generation: int, verdict: str | None, ends: bool
) -> None:
    fault = FaultRecord(1, kind, step, "ZeroDivisionError: a bug")
    why = fresh_failure(fault, generation, verdict, [RESPAWNED], window=20)
    assert (why is not None) == ends
    if why is not None:
        assert f"rank 1 raised at step {step} again in a fresh process: ZeroDivisionError: a bug" in why
        assert "retried in process 3 times and once in a fresh process" in why
        assert "not a transient fault" in why


@pytest.mark.parametrize("verdict", [None, "budget"])
def test_a_rank_still_in_its_own_process_raising_after_its_peers_were_replaced_ends_nothing(
    verdict: str | None,
) -> None:
    """Every rank raised at step 3: rank 1 used up its retries first and was replaced; rank 0,
    never replaced, raises again at step 3 (its own retry). That is no fresh process failing:
    the job once ended here, saying rank 0 raised "again in a fresh process"."""
    fault = FaultRecord(0, "exception", 3, "ZeroDivisionError: a bug")
    assert fresh_failure(fault, 5, verdict, [RESPAWNED], window=20) is None
    # once rank 0 was replaced too, its fresh process raising again ends the job
    both = [RESPAWNED, Respawn(ranks=(0,), step=3, generation=5, retries=3)]
    assert "rank 0 raised at step 3 again in a fresh process" in str(
        fresh_failure(fault, 6, verdict, both, 20)
    )


def test_nothing_was_respawned_nothing_ends() -> None:
    for kind, gen in itertools.product(("exception", "killed"), (0, 5)):
        assert fresh_failure(FaultRecord(1, kind, 3, "x"), gen, "budget", [], window=20) is None


def test_a_workers_own_limit_hands_the_rank_to_a_fresh_process_unless_off_used_up_or_unknown() -> None:
    err = "rank 1: step 3 raised ZeroDivisionError 4 times in a row"
    assert retries_spent_verdict(err, 3, allowed=16, had=0) is None
    assert retries_spent_verdict(err, 3, allowed=0, had=0) == err
    assert "used up" in str(retries_spent_verdict(err, 3, allowed=1, had=1))
    assert retries_spent_verdict(err, None, allowed=16, had=0) == err


def test_ranks_of_one_step_and_round_count_as_one_retry() -> None:
    a = Respawn((0,), 3, 4, 3)
    b = Respawn((1,), 3, 4, 3)
    c = Respawn((1,), 9, 6, 3)
    assert used([]) == 0 and used([a, b]) == 1 and used([a, b, c]) == 2


def test_retries_count_within_the_fault_window_not_the_whole_job() -> None:
    """A long job meets unrelated faults that a fresh process cures, far apart: each counts only
    near its own step, so the job is not stopped at the N+1th."""
    far = [Respawn((k % 4,), 100 * k, k, 3) for k in range(40)]
    assert used(far, step=4000, window=20) == 0 and used(far) == 40
    assert used(far, step=3910, window=20) == 1
    near = [Respawn((0,), 50 + k, 10 + k, 3) for k in range(5)]
    assert used(near, step=60, window=20) == 5 and used(near, step=70, window=20) == 5
    assert used(near, step=75, window=3) == 0


def test_tries_count_the_ranks_exceptions_near_the_step() -> None:
    history = [
        FaultRecord(1, "exception", 3, "x"),
        FaultRecord(1, "exception", 3, "x"),
        FaultRecord(1, "killed", 3, "x"),
        FaultRecord(2, "exception", 3, "x"),
        FaultRecord(1, "exception", 40, "x"),
    ]
    assert in_process_tries(history, (1,), 3, window=20) == 2
    assert in_process_tries(history, (1, 2), 3, window=20) == 3
    # an earlier raise of the rank at another step is not a retry of this one
    assert in_process_tries([FaultRecord(1, "exception", 2, "y"), *history], (1,), 3, window=20) == 2
    # a fault that moved on with the steps: its raises within the window, as the budget counts them
    moving = [FaultRecord(1, "exception", s, "x") for s in (11, 12, 13, 14)]
    assert in_process_tries(moving, (1,), 14, window=20) == 4
    assert in_process_tries(moving, (1,), 14, window=1) == 2


def test_no_state_left_names_the_ranks_the_step_and_the_plans_reason() -> None:
    why = no_state_left(
        "no rank holds a valid replica", [Respawn((0,), 3, 4, 3, "E0"), Respawn((1,), 3, 4, 3, "E1")]
    )
    assert "rank(s) [0, 1] used up their in-process retries of step 3 (E1)" in why
    assert "no rank holds a valid replica" in why
