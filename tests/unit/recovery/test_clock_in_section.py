"""Inside a section the hang rule sees progress now: a long section is judged by silence only."""

from __future__ import annotations

import time

import pytest

from checkpointless.coordinator.messages import apply_heartbeat
from checkpointless.coordinator.rules.hangs import WorkerHealth, find_hung
from checkpointless.coordinator.state import Member
from checkpointless.recovery.clock import StepClock

pytestmark = pytest.mark.timeout(10)


def test_a_rank_working_in_a_section_past_the_limit_is_not_taken_for_hung() -> None:
    clock = StepClock()
    clock.started = True
    clock.begin(4, 0.0)
    clock.commit(0.0)
    clock.progress_t -= 100.0  # the last step committed long ago: the section has run since
    assert clock.heartbeat(None).progress_age == pytest.approx(100.0, abs=1.0)  # between steps
    clock.in_section = "eval"
    beat = clock.heartbeat(None)
    assert beat.progress_age == 0.0
    m = Member(worker_id=0, role="worker", spawned=0.0, rank=0)
    now = time.monotonic()
    apply_heartbeat(m, now, beat.step, beat.progress_age, beat.in_collective, beat.step_time)
    health = [WorkerHealth(0, m.last_message, m.last_progress, m.in_collective)]
    assert find_hung(health, now + 5.0, hang_timeout=10.0) == ([], "")
    # its silence still counts
    assert find_hung(health, now + 11.0, hang_timeout=10.0)[0] == [0]


def test_no_progress_age_while_recovering_or_before_the_loop() -> None:
    clock = StepClock()
    assert clock.heartbeat(None).progress_age is None  # before job.steps()
    clock.started, clock.recovering, clock.in_section = True, True, "eval"
    assert clock.heartbeat(None).progress_age is None
