"""The coordinator holds no state that grows with the step count (issue 36): a job of a million
steps must not grow its memory by the step. Driven as a pure state machine, the way the shell
drives it, with every rank's heartbeats (step, step and busy times) and the loop's ticks."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from checkpointless.protocol import Heartbeat
from tests.unit.coordinator.test_coordinator import Harness, start_job

pytestmark = pytest.mark.timeout(170)


def _train(h: Harness, first: int, last: int) -> None:
    for step in range(first, last):
        for wid in range(3):
            h.c.on_message(
                wid,
                Heartbeat(step=step, progress_age=0.01, step_time=0.05 + 0.001 * wid, busy_time=0.04),
                h.now,
                1e9 + h.now,
            )
        h.now += 0.05
        if step % 5 == 0:  # the shell's loop turns about every 100 ms while a job trains
            h.c.tick(h.now, 1e9 + h.now)
            h.c.drain()


def test_coordinator_memory_after_100k_steps_is_within_a_mb_of_that_after_1k() -> None:
    h = Harness()
    start_job(h)
    _train(h, 1, 1_000)
    gc.collect()
    tracemalloc.start()
    try:
        at_1k = tracemalloc.take_snapshot()
        _train(h, 1_000, 100_000)
        gc.collect()
        at_100k = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    growth = sum(d.size_diff for d in at_100k.compare_to(at_1k, "filename"))
    top = [str(d) for d in at_100k.compare_to(at_1k, "lineno")[:5]]
    assert growth < 1 << 20, (growth, top)
    assert not h.events("fault"), "steady heartbeats are no fault"
