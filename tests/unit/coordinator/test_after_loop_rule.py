"""The rule for a round open after some rank has left its loop (coordinator/rules/after_loop.py)."""

from __future__ import annotations

import pytest

from checkpointless.coordinator.rules.after_loop import after_the_loop

pytestmark = pytest.mark.timeout(30)


def test_a_rank_lost_after_the_loop_ends_the_job_at_once_naming_it() -> None:
    why = after_the_loop([0, 1], [2], [], [2, 3], target=4, waited=0.0, timeout=60.0)
    assert why is not None and "rank(s) [2] were lost" in why and "rank(s) [0, 1] had left" in why


def test_a_rank_caught_in_the_final_barrier_ends_the_job_at_once() -> None:
    why = after_the_loop([0], [], [1], [1], target=4, waited=0.0, timeout=60.0)
    assert why is not None and "rank(s) [1] were interrupted" in why


def test_the_rest_may_finish_until_the_recovery_timeout() -> None:
    assert after_the_loop([0], [], [], [1, 2], target=4, waited=59.0, timeout=60.0) is None
    why = after_the_loop([0], [], [], [1, 2], target=4, waited=61.0, timeout=60.0)
    assert why is not None and "generation 4: ranks [1, 2] neither finished nor reported" in why
