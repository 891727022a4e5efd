"""Whether a protected section completed, as the ranks agree on it in a recovery.

A rank whose closing barrier failed as its peer passed it (an abort landing as the barrier
completed, the barrier not completing within its settle time) reports the section as not
passed, its peer as passed. The plan (``Recover.plan.sections_closed``) says done if any valid
member at the target step passed it (coordinator/rules/sections.py), and every rank takes that
(``LoopControl.agree``): none redoes it against a peer's next step.
"""

from __future__ import annotations

import itertools
import json

import pytest

from checkpointless.coordinator.rules.decisions import MemberReport
from checkpointless.coordinator.rules.sections import closed_sections
from checkpointless.protocol import Recover, ResumePlan, Stopped, decode, encode
from checkpointless.recovery.loop import LoopControl
from tests.unit.coordinator.test_coordinator import Harness, start_job

pytestmark = pytest.mark.timeout(10)


def report(rank: int, step: int, valid: bool = True, closed: tuple[str, ...] = ()) -> MemberReport:
    return MemberReport(rank, step, valid, sections_closed=closed)


def test_one_rank_past_the_barrier_makes_the_section_done_for_every_rank() -> None:
    # rank 1 passed the barrier of "eval" after 10 steps; rank 0's failed as it completed
    reports = [report(0, 10), report(1, 10, closed=("eval",))]
    assert closed_sections(reports, 10) == ("eval",)
    # nobody passed it: every rank redoes it
    assert closed_sections([report(0, 10), report(1, 10)], 10) == ()


def test_only_valid_reports_at_the_target_boundary_count() -> None:
    # a replacement (invalid, no step) says nothing; nor does a rank that faulted in its update
    assert closed_sections([report(0, 10), report(1, -1, valid=False, closed=("eval",))], 10) == ()
    assert closed_sections([report(0, 10), report(1, 10, valid=False, closed=("eval",))], 10) == ()
    # a section passed at another boundary is not this one's (the job resumes at 12)
    assert closed_sections([report(0, 12), report(1, 10, closed=("eval",))], 12) == ()


def test_several_sections_are_the_union_sorted() -> None:
    reports = [report(0, 4, closed=("save",)), report(1, 4, closed=("eval", "save")), report(2, 4)]
    assert closed_sections(reports, 4) == ("eval", "save")


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_done_exactly_when_some_valid_member_at_the_target_passed(ranks: int) -> None:
    """Every combination of (step, valid, passed) per rank, on 1 to 3 ranks."""
    states = list(itertools.product((9, 10), (True, False), (True, False)))
    for combo in itertools.product(states, repeat=ranks):
        reports = [
            report(r, step, valid, ("eval",) if passed else ())
            for r, (step, valid, passed) in enumerate(combo)
        ]
        want = any(step == 10 and valid and passed for step, valid, passed in combo)
        assert closed_sections(reports, 10) == (("eval",) if want else ()), combo


def test_the_report_and_the_plan_carry_it_on_the_wire() -> None:
    stopped = Stopped(for_generation=3, committed_step=10, valid=True, sections_closed=["eval"])
    assert decode(json.loads(json.dumps(encode(stopped)))) == stopped
    plan = Recover(generation=3, rendezvous={"kind": "tcp"}, plan=ResumePlan(10, 0, sections_closed=["eval"]))
    assert decode(json.loads(json.dumps(encode(plan)))) == plan
    # unset, it does not travel (the plan's optional fields never did)
    assert "sections_closed" not in encode(Recover(generation=3, rendezvous={}, plan=ResumePlan(10)))["plan"]


def test_the_loop_reports_what_it_passed_and_takes_the_plans_decision() -> None:
    loop = LoopControl()
    loop.sections_done = {"eval": 10, "save": 5}
    assert loop.closed_at(10) == ["eval"] and loop.closed_at(5) == ["save"] and loop.closed_at(7) == []
    peer = LoopControl()
    peer.sections_done = {"save": 5}  # its barrier of "eval" at 10 failed
    peer.agree(["eval"], 10)
    assert peer.sections_done == {"eval": 10, "save": 5}


def plans_after(rank0: Stopped) -> dict[int, Recover]:
    """The plans of a round in which rank 1 is lost, rank 0 reports ``rank0``, rank 2 stops at
    step 10 without having passed a section there."""
    h = Harness()
    start_job(h)
    h.exit(1, -9)  # a round opens; rank 1 goes to the ready spare (worker 3)
    h.advance(0.01)
    out = h.msg(0, rank0)
    out += h.msg(2, Stopped(for_generation=1, committed_step=10, valid=True))
    out += h.msg(3, Stopped(for_generation=1, committed_step=-1, valid=False))
    out += h.advance(0.01)
    plans = h.sent(out, Recover)
    assert set(plans) == {0, 2, 3}, out
    closed = {"sections_closed": plans[0].plan.sections_closed} if plans[0].plan.sections_closed else {}
    assert {k: v for k, v in h.events("plan")[-1].items() if k == "sections_closed"} == closed
    return plans


def test_the_coordinator_sends_every_member_the_decision() -> None:
    passed = plans_after(Stopped(for_generation=1, committed_step=10, valid=True, sections_closed=["eval"]))
    assert all(p.plan.sections_closed == ["eval"] and p.plan.target_step == 10 for p in passed.values())
    # nobody reports a section passed at 10: it is due on every rank
    earlier = plans_after(Stopped(for_generation=1, committed_step=10, valid=True))
    assert all(p.plan.sections_closed == [] for p in earlier.values())
