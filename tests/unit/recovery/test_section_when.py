"""A section with ``when`` (recovery/sections.py): it runs at a boundary only where ``when`` says
so, the answer is asked once per boundary and a no is settled in the loop state's ``done``, and a
section that completed or is not in its period is not asked at all."""

from __future__ import annotations

import pytest

from checkpointless.recovery.schedule import StepSchedule
from checkpointless.recovery.sections import Section, due_sections


class Asked:
    """A ``when`` that answers from a set of boundaries and counts its calls."""

    def __init__(self, yes: set[int]) -> None:
        self.yes = yes
        self.calls: list[int] = []
        self.at = 0  # the boundary the test is at

    def __call__(self) -> bool:
        self.calls.append(self.at)
        return self.at in self.yes


@pytest.mark.timeout(10)
def test_a_section_runs_only_where_when_says_so_and_a_no_is_settled() -> None:
    when = Asked({3})
    sec = Section("boundary", lambda: None, every=1, when=when)
    done: dict[str, int] = {}
    for at in (1, 2):
        when.at = at
        assert due_sections([sec], at, done) == []
        assert done == {"boundary": at}, "a no is entered as settled at this boundary"
        assert due_sections([sec], at, done) == [], "not asked again at the same boundary"
    when.at = 3
    assert due_sections([sec], 3, done) == [sec]
    assert due_sections([sec], 3, done) == [sec], "due until it completes (a redo after a fault)"
    assert done == {"boundary": 2}
    done["boundary"] = 3  # it completed (driver.py)
    assert due_sections([sec], 3, done) == []
    assert when.calls == [1, 2, 3, 3]


@pytest.mark.timeout(10)
def test_when_is_not_asked_outside_the_period_nor_before_step_0() -> None:
    when = Asked(set())
    sec = Section("eval", lambda: None, every=4, when=when)
    done: dict[str, int] = {}
    for at in (0, 1, 2, 3, 5):
        assert due_sections([sec], at, done) == []
    assert when.calls == [] and done == {}
    plain = Section("plain", lambda: None, every=4)
    assert due_sections([sec, plain], 4, done) == [plain]
    assert done == {"eval": 4} and when.calls == [0]


@pytest.mark.timeout(10)
def test_the_schedule_registers_when() -> None:
    schedule = StepSchedule()
    schedule.add_section("a", lambda: None, 2, False, when=lambda: False)
    schedule.add_section("b", lambda: None, 2, False)
    assert schedule.sections[0].when is not None and schedule.sections[1].when is None
