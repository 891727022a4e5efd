"""How long a round waits for a rank that has not reported (coordinator/rules/round_wait.py), and
the coordinator through a start-up slower than --recovery-timeout."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpointless.coordinator import Send, Spawn, Stop
from checkpointless.coordinator.coordinator import Coordinator
from checkpointless.coordinator.rules.round_wait import Waiting, overdue
from checkpointless.protocol import Recover, Stopped
from tests.helpers.coordinator import new_coordinator

pytestmark = pytest.mark.timeout(30)


def test_a_connected_rank_has_the_recovery_timeout_from_its_assignment() -> None:
    w = [Waiting(rank=1, connected=True, spawned=0.0, assigned_at=50.0)]
    assert overdue(w, round_started=10.0, now=169.0, recovery_timeout=120.0, start_timeout=180.0) == []
    assert overdue(w, round_started=10.0, now=171.0, recovery_timeout=120.0, start_timeout=180.0) == [1]


def test_a_starting_process_is_the_start_timeouts_then_the_recovery_timeouts() -> None:
    w = [Waiting(rank=0, connected=False, spawned=0.0, assigned_at=0.0)]
    # past --recovery-timeout, still within --start-timeout: its agent judges it, not the round
    assert overdue(w, 0.0, now=150.0, recovery_timeout=120.0, start_timeout=180.0) == []
    assert overdue(w, 0.0, now=299.0, recovery_timeout=120.0, start_timeout=180.0) == []
    assert overdue(w, 0.0, now=301.0, recovery_timeout=120.0, start_timeout=180.0) == [0]


def test_ranks_come_back_in_rank_order() -> None:
    w = [Waiting(3, True, 0.0, 0.0), Waiting(0, True, 0.0, 0.0), Waiting(2, False, 0.0, 0.0)]
    assert overdue(w, 0.0, now=1000.0, recovery_timeout=1.0, start_timeout=1.0) == [0, 2, 3]


@given(
    connected=st.booleans(),
    spawned=st.floats(0, 1e4),
    assigned=st.floats(0, 1e4),
    started=st.floats(0, 1e4),
    rt=st.floats(0.1, 1e3),
    stt=st.floats(0.1, 1e3),
    now=st.floats(0, 3e4),
)
def test_never_sooner_than_the_rounds_own_recovery_timeout(
    connected: bool, spawned: float, assigned: float, started: float, rt: float, stt: float, now: float
) -> None:
    """Whatever the process, the round never fails it sooner than it did before this rule, and a
    starting process never sooner than its start-up limit."""
    late = overdue([Waiting(0, connected, spawned, assigned)], started, now, rt, stt)
    if now <= started + rt:
        assert late == []
    if not connected and now <= spawned + stt:
        assert late == []


def _report_all(c: Coordinator, spawns: list[int], now: float) -> None:
    for wid in spawns:
        c.on_message(wid, Stopped(for_generation=0, committed_step=0, valid=True, cause="start"), now, 1e9)


def test_a_start_up_slower_than_the_recovery_timeout_forms_generation_0() -> None:
    """A loaded host: the fork template takes 150 s to import before any worker connects. The
    round waits (the agents judge starting processes by --start-timeout and CPU progress), and
    generation 0 forms once they connect and report."""
    c = new_coordinator(2, 0, recovery_timeout=120.0, start_timeout=180.0)
    c.start(100.0)
    spawns = [x.worker_id for x in c.drain() if isinstance(x, Spawn)]
    for wid in spawns:
        c.on_started(wid, f"127.0.0.1:{30000 + wid}")
    c.tick(250.0, 1e9)  # 150 s in, nobody connected
    assert not [x for x in c.drain() if isinstance(x, Stop)], "the start-up was failed as a recovery"
    for wid in spawns:
        assert c.on_connected(wid, 250.0)
    _report_all(c, spawns, 251.0)
    c.tick(251.1, 1e9)
    plans = [x for x in c.drain() if isinstance(x, Send) and isinstance(x.message, Recover)]
    assert {p.worker_id for p in plans} == set(spawns)


def test_a_connected_rank_that_never_reports_still_fails_the_start_up() -> None:
    c = new_coordinator(2, 0, recovery_timeout=120.0, start_timeout=180.0)
    c.start(100.0)
    spawns = [x.worker_id for x in c.drain() if isinstance(x, Spawn)]
    for wid in spawns:
        c.on_started(wid, f"127.0.0.1:{30000 + wid}")
        assert c.on_connected(wid, 110.0)
    _report_all(c, spawns[:1], 111.0)
    c.tick(229.0, 1e9)
    assert not [x for x in c.drain() if isinstance(x, Stop)]
    c.tick(231.0, 1e9)
    stops = [x for x in c.drain() if isinstance(x, Stop)]
    assert stops and "ranks [1] never reported within --recovery-timeout" in str(stops[0]), stops
