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
from pathlib import Path

import pytest

from checkpointless.coordinator.rules.decisions import MemberReport
from checkpointless.coordinator.rules.sections import closed_sections, doubtful_sections, unheard_ranks
from checkpointless.protocol import Recover, ResumePlan, Stopped, decode, encode
from checkpointless.recovery.loop import LoopControl
from checkpointless.recovery.section_pass import PassMark
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


def test_a_lost_ranks_replacement_reports_what_its_predecessor_passed() -> None:
    # rank 1 passed the barrier after 10 steps and was lost at once; rank 0's barrier failed.
    # Its replacement (invalid, no step of its own) reports the mark rank 1 left on its host
    joined = MemberReport(1, -1, False, sections_closed=("eval",), sections_step=10)
    assert closed_sections([report(0, 10), joined], 10) == ("eval",)
    # a mark of an earlier boundary says nothing about this one
    older = MemberReport(1, -1, False, sections_closed=("eval",), sections_step=5)
    assert closed_sections([report(0, 10), older], 10) == ()
    # every replica lost (nobody valid at the target: the job goes back to a snapshot, whose
    # state has the sections as they were saved): a mark does not count
    assert closed_sections([report(0, 10, valid=False), joined], 10) == ()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_done_exactly_when_some_member_at_the_target_passed(ranks: int) -> None:
    """Every combination per rank of a survivor's (step, valid, passed) or a replacement's mark
    (none, or the section at step 9 or 10), on 1 to 3 ranks."""
    survivors = [
        (step, valid, passed, None)
        for step, valid, passed in itertools.product((9, 10), (True, False), (True, False))
    ]
    joiners = [(-1, False, mark is not None, mark) for mark in (None, 9, 10)]
    for combo in itertools.product(survivors + joiners, repeat=ranks):
        reports = [
            MemberReport(r, step, valid, sections_closed=("eval",) if passed else (), sections_step=mark)
            for r, (step, valid, passed, mark) in enumerate(combo)
        ]
        live = any(step == 10 and valid for step, valid, _, _ in combo)
        passed_here = any(
            passed and (mark == 10 if mark is not None else step == 10 and valid)
            for step, valid, passed, mark in combo
        )
        want = live and passed_here
        assert closed_sections(reports, 10) == (("eval",) if want else ()), combo


def test_a_pass_mark_is_read_back_and_a_bad_one_is_none(tmp_path: Path) -> None:
    mark = PassMark(tmp_path, 3)
    assert mark.read() is None
    mark.mark(10, "eval")
    assert PassMark(tmp_path, 3).read() == (10, "eval", True)  # by a replacement on the same host
    assert PassMark(tmp_path, 2).read() is None  # another rank's
    mark.mark(20, "save", passed=False)  # entered the barrier; passing it rewrites the mark
    assert mark.read() == (20, "save", False)
    mark.mark(20, "save")
    assert mark.read() == (20, "save", True)
    (tmp_path / "rank3.passed").write_text('{"step": 4, "section": "eval"}')  # an older mark
    assert mark.read() == (4, "eval", True)
    (tmp_path / "rank3.passed").write_text('{"step": 4, "section": "eval", "passed": 1}')
    assert mark.read() is None
    (tmp_path / "rank3.passed").write_text('{"step": "x", "section": "eval"}')
    assert mark.read() is None
    (tmp_path / "rank3.passed").write_text("{")
    assert mark.read() is None
    off = PassMark(None, 3)  # not under the launcher: nothing kept
    off.mark(10, "eval")
    assert off.read() is None


def test_the_report_and_the_plan_carry_it_on_the_wire() -> None:
    stopped = Stopped(for_generation=3, committed_step=10, valid=True, sections_closed=["eval"])
    assert decode(json.loads(json.dumps(encode(stopped)))) == stopped
    joined = Stopped(
        for_generation=3, committed_step=-1, valid=False, sections_closed=["eval"], sections_step=10
    )
    assert decode(json.loads(json.dumps(encode(joined)))) == joined
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


def plans_after(rank0: Stopped, spare: Stopped | None = None) -> dict[int, Recover]:
    """The plans of a round in which rank 1 is lost, rank 0 reports ``rank0``, rank 2 stops at
    step 10 without having passed a section there, and the spare taking rank 1 reports
    ``spare`` (by default, nothing of its predecessor)."""
    h = Harness()
    start_job(h)
    h.exit(1, -9)  # a round opens; rank 1 goes to the ready spare (worker 3)
    h.advance(0.01)
    out = h.msg(0, rank0)
    out += h.msg(2, Stopped(for_generation=1, committed_step=10, valid=True))
    out += h.msg(3, spare or Stopped(for_generation=1, committed_step=-1, valid=False))
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
    # rank 1 passed it and was lost; its replacement reports the mark it left on its host
    mark = Stopped(
        for_generation=1, committed_step=-1, valid=False, sections_closed=["eval"], sections_step=10
    )
    by_mark = plans_after(Stopped(for_generation=1, committed_step=10, valid=True), mark)
    assert all(p.plan.sections_closed == ["eval"] for p in by_mark.values())


def entered(
    rank: int, step: int, valid: bool, ranks: tuple[int, ...], mark: int | None = None
) -> MemberReport:
    """A report that ``ranks`` entered the closing barrier of "eval" and nobody knows if they
    passed (a keeper's report: its own barrier failed there too)."""
    left = ("eval",) if valid else ()
    return MemberReport(
        rank, step, valid, sections_step=mark, sections_entered=(("eval", ranks),), sections_left=left
    )


def failed(rank: int, step: int) -> MemberReport:
    """A live rank whose own closing barrier of "eval" failed at ``step``."""
    return MemberReport(rank, step, True, sections_left=("eval",))


def test_a_lost_rank_that_may_have_passed_makes_the_redo_doubtful() -> None:
    # rank 1 was SIGKILLed between its barrier's completion and its pass mark; rank 0's barrier
    # failed. Its replacement finds the mark it left as it entered: the section is redone, in doubt
    joined = entered(1, -1, False, (1,), mark=10)
    assert closed_sections([failed(0, 10), joined], 10) == ()
    assert doubtful_sections([failed(0, 10), joined], 10) == {"eval": (1,)}
    # rank 0 never entered the barrier (a fault in the section's work): nobody can have passed
    assert doubtful_sections([report(0, 10), joined], 10) == {}
    # a keeper one host over whose wait for its owner's pass ran out says the same of rank 1
    assert doubtful_sections([entered(0, 10, True, (1,)), report(1, -1, False)], 10) == {"eval": (1,)}
    # some rank passed it after all: it is done, not redone, nothing in doubt
    passed = report(2, 10, closed=("eval",))
    assert doubtful_sections([failed(0, 10), joined, passed], 10, closed=["eval"]) == {}
    # a mark of another boundary, or a report from behind the target, says nothing of this one
    assert doubtful_sections([failed(0, 10), entered(1, -1, False, (1,), mark=5)], 10) == {}
    assert doubtful_sections([failed(0, 10), entered(1, 9, True, (1,))], 10) == {}
    # nobody valid at the target: the job goes back to a copy, whose state has the sections
    assert doubtful_sections([report(0, 10, valid=False), joined], 10) == {}
    # two lost ranks, one named by its replacement, one by its keeper: both, sorted
    both = [entered(0, 10, True, (3,)), joined, report(3, -1, False)]
    assert doubtful_sections(both, 10) == {"eval": (1, 3)}


@pytest.mark.timeout(60)  # 50,653 combinations on 3 ranks: ~1 s on a quiet core
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_doubtful_exactly_when_entered_here_every_live_rank_failed_it_and_nobody_passed(ranks: int) -> None:
    """Every combination per rank of a survivor's (step, valid, passed, keeper's doubt, own
    barrier failed) or a replacement's mark (none; passed or entered, at step 9 or 10), on 1 to
    3 ranks."""
    flags = (True, False)
    survivors = [(*c, None) for c in itertools.product((9, 10), flags, flags, flags, flags)]
    joiners = [(-1, False, p, not p, False, m) for m in (9, 10) for p in flags]
    joiners.append((-1, False, False, False, False, None))
    for combo in itertools.product(survivors + joiners, repeat=ranks):
        reports = [
            MemberReport(
                r,
                step,
                valid,
                sections_closed=("eval",) if passed else (),
                sections_step=mark,
                sections_entered=(("eval", (r,)),) if doubt else (),
                sections_left=("eval",) if left else (),
            )
            for r, (step, valid, passed, doubt, left, mark) in enumerate(combo)
        ]
        closed = closed_sections(reports, 10)
        counted = [
            r
            for r, (step, valid, _, doubt, _, mark) in enumerate(combo)
            if doubt and (mark == 10 if mark is not None else step == 10 and valid)
        ]
        live = [left for step, valid, _, _, left, _ in combo if step == 10 and valid]
        want = {"eval": tuple(counted)} if live and all(live) and counted and not closed else {}
        assert doubtful_sections(reports, 10, closed) == want, combo


def test_the_coordinator_reports_a_doubtful_redo_as_inexact() -> None:
    entered_mark = Stopped(
        for_generation=1, committed_step=-1, valid=False, sections_entered={"eval": [1]}, sections_step=10
    )
    assert decode(json.loads(json.dumps(encode(entered_mark)))) == entered_mark
    h = Harness()
    start_job(h)
    h.exit(1, -9)
    h.advance(0.01)
    left = Stopped(for_generation=1, committed_step=10, valid=True, sections_left=["eval"])
    assert decode(json.loads(json.dumps(encode(left)))) == left
    out = h.msg(0, left)
    out += h.msg(2, left)
    out += h.msg(3, entered_mark)
    out += h.advance(0.01)
    plans = h.sent(out, Recover)
    assert set(plans) == {0, 2, 3} and all(p.plan.sections_closed == [] for p in plans.values())
    (event,) = h.events("inexact")
    assert event["what"] == "section" and event["section"] == "eval" and event["ranks"] == [1]
    assert event["rank"] == 1 and event["step"] == 10 and "may appear twice" in event["detail"]


def test_a_rank_lost_with_its_host_and_its_keeper_is_unheard_and_its_redo_doubtful() -> None:
    # ranks 2 and 3 lost with their host; 2's keeper (rank 0) was lost too and has a replacement,
    # 3's keeper (rank 1) reports as the process that ran the job
    keeper = {2: 0, 3: 1}.get
    reports = [report(0, -1, valid=False), failed(1, 10), report(2, -1, False), report(3, -1, False)]
    assert unheard_ranks({2, 3}, reports, keeper) == (2,)
    # every live rank entered and failed the barrier: nothing rules rank 2's pass out
    assert doubtful_sections(reports, 10, unheard=(2,)) == {"eval": (2,)}
    # a live rank that never entered it rules it out; a rank that passed it closes it
    assert doubtful_sections([report(1, 10), *reports[2:]], 10, unheard=(2,)) == {}
    assert doubtful_sections([*reports, report(4, 10, closed=("eval",))], 10, ["eval"], (2,)) == {}
    # a rank lost alone (its host alive: its replacement reads its mark there) is never unheard
    assert unheard_ranks(set(), reports, keeper) == ()
    # no keeper at all (a job of one rank) is no report either
    assert unheard_ranks({0}, [report(1, 10)], lambda rank: None) == (0,)


def test_the_coordinator_reports_the_redo_of_a_rank_lost_with_its_keeper_as_inexact() -> None:
    # 2 hosts x 2 ranks and a spare host: host 1 (ranks 2-3) is lost as rank 0, the keeper of
    # rank 2's records one host over, is killed; rank 1, the keeper of rank 3's, lives on
    from checkpointless.coordinator.state import Emit, Spawn
    from checkpointless.protocol import SpareReady
    from tests.helpers.coordinator import formed_host_job

    c, _ = formed_host_job(ready=2)
    for h in (0, 2):
        c.on_agent_seen(h, 102.0)
    c.on_host_lost(1, "connection closed", 102.0, 1e9)
    c.on_exit(0, -9, False, "SIGKILL", "", 102.0, 1e9)
    c.tick(102.1, 1e9)
    late = next(x.worker_id for x in c.drain() if isinstance(x, Spawn) and x.host == 2)
    c.on_started(late, "10.0.0.2:30100")  # a third spare for the third lost rank
    c.on_connected(late, 102.2)
    c.on_message(late, SpareReady(), 102.2, 1e9)
    c.tick(102.2, 1e9)
    c.drain()
    left = Stopped(for_generation=1, committed_step=10, valid=True, sections_left=["eval"])
    c.on_message(1, left, 102.3, 1e9)
    for w in [w for w, m in c.procs.items() if m.rank in (0, 2, 3)]:
        c.on_message(w, Stopped(for_generation=1, committed_step=-1, valid=False), 102.3, 1e9)
    c.tick(102.4, 1e9)
    events = [x.fields for x in c.drain() if isinstance(x, Emit) and x.event == "inexact"]
    assert [(e["section"], e["ranks"]) for e in events] == [("eval", [2])], events
