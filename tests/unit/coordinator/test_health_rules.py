"""Health-gated admission: the pure quarantine rules (coordinator/rules/health.py) and the
coordinator's gate driven as a state machine (coordinator/health.py, the spare pool's promotion).

A job of 2 hosts x 2 ranks and a spare host (tests/helpers/coordinator.formed_host_job): host 0
holds ranks 0-1, host 1 ranks 2-3, host 2 two ready spares. Host 1 is lost; whether its ranks move
to host 2 depends on host 2's health reports.
"""

from __future__ import annotations

import pytest

from checkpointless.coordinator import Coordinator
from checkpointless.coordinator.rules.health import (
    HealthRecord,
    after_fault,
    after_report,
    blocked_because,
    fresh_for,
    promotable,
)
from checkpointless.coordinator.state import Emit, Log, Send, Stop
from checkpointless.protocol import Assign, HealthReport
from tests.helpers.coordinator import formed_host_job

pytestmark = pytest.mark.timeout(60)


# -- the pure rules -----------------------------------------------------------------------------
def test_a_failing_report_quarantines_and_a_passing_one_readmits() -> None:
    rec, change = after_report(HealthRecord(), False, "memory: MemoryError", 10.0)
    assert rec.quarantine == "health" and rec.why == "memory: MemoryError" and rec.ok is False
    assert change is not None and (change.kind, change.reason) == ("quarantined", "health")
    again, change = after_report(rec, False, "memory: still", 20.0)
    assert change is None and again.why == "memory: still"  # one quarantine, its newest output
    back, change = after_report(again, True, "", 30.0)
    assert back.quarantine == "" and back.ok and back.checked_at == 30.0
    assert change is not None and (change.kind, change.reason) == ("readmitted", "health")


def test_readmission_may_wait_for_several_passes() -> None:
    rec, _ = after_report(HealthRecord(), False, "x", 1.0)
    rec, change = after_report(rec, True, "", 2.0, readmit_after=2)
    assert change is None and rec.quarantine == "health" and rec.passes == 1
    rec, change = after_report(rec, True, "", 3.0, readmit_after=2)
    assert change is not None and change.kind == "readmitted" and rec.quarantine == ""


def test_faults_at_k_distinct_steps_within_the_window_quarantine_a_host() -> None:
    rec = HealthRecord()
    rec, change = after_fault(rec, 10, "exception", window=20, limit=3)
    rec, change = after_fault(rec, 10, "killed", window=20, limit=3)  # the same step: one incident
    assert change is None and rec.fault_steps == (10,)
    rec, change = after_fault(rec, 12, "comm", window=20, limit=3)  # a symptom never counts
    assert change is None and rec.fault_steps == (10,)
    rec, change = after_fault(rec, 15, "exit", window=20, limit=3)
    assert change is None
    rec, change = after_fault(rec, 31, "exit", window=20, limit=3)  # step 10 has left the window
    assert change is None and rec.fault_steps == (15, 31)
    rec, change = after_fault(rec, 32, "hang", window=20, limit=3)
    assert change is not None and change.reason == "faults" and rec.quarantine == "faults"
    assert "[15, 31, 32]" in rec.why and "--host-fault-limit 3" in rec.why
    assert after_fault(HealthRecord(), 5, "exit", window=20, limit=0) == (HealthRecord(), None)  # off


def test_a_fault_quarantine_ends_once_the_job_is_past_the_window_and_a_check_passed() -> None:
    rec = HealthRecord(ok=True, checked_at=0.0, quarantine="faults", why="w", fault_steps=(3, 5, 8))
    held, change = after_report(rec, True, "", 10.0, step=20, window=20)
    assert change is None and held.quarantine == "faults"  # step 8 is within 20 steps of 20
    back, change = after_report(held, True, "", 20.0, step=29, window=20)
    assert change is not None and (change.kind, change.reason) == ("readmitted", "faults")
    assert back.quarantine == "" and back.fault_steps == ()
    # failing checks take over the quarantine from the faults
    sick, change = after_report(rec, False, "room: full", 30.0, step=50, window=20)
    assert change is not None and sick.quarantine == "health" and sick.why == "room: full"


def test_promotion_needs_a_passing_fresh_report() -> None:
    max_age = fresh_for(60.0, 30.0)
    assert max_age == 150.0 and fresh_for(0.0, 30.0) == 0.0
    assert blocked_because(None, 0.0, max_age) == "no health report yet"
    ok = HealthRecord(ok=True, checked_at=100.0)
    assert promotable(ok, 200.0, max_age) and not promotable(ok, 251.0, max_age)
    assert "151 s old" in blocked_because(ok, 251.0, max_age)
    assert promotable(ok, 1e9, 0.0)  # agents that check only as they join: any age
    sick = HealthRecord(ok=False, checked_at=100.0, detail="d", quarantine="health", why="cmd: exit 1")
    assert blocked_because(sick, 100.0, max_age) == "quarantined (health): cmd: exit 1"


# -- the coordinator's gate ---------------------------------------------------------------------
def _report(ok: bool, detail: str = "", age: float = 0.0) -> HealthReport:
    return HealthReport(
        ok=ok, age=age, names=["memory", "command:check"], passed=[True, ok], details=["fine", detail],
        seconds=[0.1, 0.2],
    )  # fmt: skip


def _lose_host_1(c: Coordinator, at: float) -> None:
    for h in (0, 2):
        c.on_agent_seen(h, at)
    c.on_host_lost(1, "connection closed", at, 1e9)
    for w in (0, 1):  # host 0's ranks stop for the round
        from checkpointless.protocol import Stopped

        c.on_message(w, Stopped(for_generation=1, committed_step=10, valid=True), at, 1e9)


def _assigned(out: list[object]) -> dict[int, int]:
    return {x.message.rank: x.worker_id for x in out if isinstance(x, Send) and isinstance(x.message, Assign)}


def _events(out: list[object], name: str) -> list[dict[str, object]]:
    return [x.fields for x in out if isinstance(x, Emit) and x.event == name]


def test_a_healthy_spare_host_is_promoted_and_its_health_is_an_event() -> None:
    c, spares = formed_host_job(ready=2)
    c.health.expect(2)
    c.on_host_health(2, _report(True), 101.5)
    out = c.drain()
    ev = _events(out, "host_health")
    assert len(ev) == 1 and ev[0]["ok"] is True and ev[0]["address"] == "10.0.0.2", ev
    assert [ch["name"] for ch in ev[0]["checks"]] == ["memory", "command:check"]  # type: ignore[union-attr]
    c.on_host_health(2, _report(True), 102.0)
    assert not _events(c.drain(), "host_health")  # the same verdict again: no new event
    _lose_host_1(c, 103.0)
    c.tick(103.0, 1e9)
    assert _assigned(c.drain()) == {2: spares[0], 3: spares[1]}


def test_a_spare_host_without_a_report_yet_waits_for_it() -> None:
    c, spares = formed_host_job(ready=2)
    c.health.expect(2)  # its agent said it checks its host; no report has come
    _lose_host_1(c, 103.0)
    c.tick(103.0, 1e9)
    assert _assigned(c.drain()) == {}
    c.on_host_health(2, _report(True, age=0.5), 104.0)
    c.tick(104.0, 1e9)
    assert _assigned(c.drain()) == {2: spares[0], 3: spares[1]}


def test_a_stale_report_is_no_report() -> None:
    c, spares = formed_host_job(ready=2, health_interval=10.0, health_timeout=5.0)
    c.health.expect(2)
    c.on_host_health(2, _report(True, age=1.0), 102.0)  # its checks finished at 101
    _lose_host_1(c, 127.0)  # 26 s later: older than two intervals and a timeout (25 s)
    c.tick(127.0, 1e9)
    assert _assigned(c.drain()) == {}
    c.on_host_health(2, _report(True), 128.0)
    c.tick(128.0, 1e9)
    assert _assigned(c.drain()) == {2: spares[0], 3: spares[1]}


def test_a_quarantined_spare_host_is_never_promoted_and_the_job_fails_naming_it() -> None:
    c, _ = formed_host_job(ready=2, spare_wait=5.0, when_no_spare="fail")
    c.health.expect(2)
    c.on_host_health(2, _report(False, "exit 1: GPU 3 missing"), 101.5)
    out = c.drain()
    q = _events(out, "host_quarantined")
    assert q == [
        {
            "host": 2,
            "address": "10.0.0.2",
            "reason": "health",
            "detail": "command:check: exit 1: GPU 3 missing",
        }
    ]
    assert any(isinstance(x, Log) and "quarantined" in x.text for x in out)
    _lose_host_1(c, 103.0)
    for t in (103.0, 105.0, 107.0, 109.0):
        c.on_agent_seen(0, t)
        c.on_agent_seen(2, t)
        c.tick(t, 1e9)
        out = c.drain()
        assert _assigned(out) == {}
        # no new spare goes onto the quarantined host either
        assert not [x for x in out if type(x).__name__ == "Spawn" and getattr(x, "host", None) == 2]
    stops = [x for x in out if isinstance(x, Stop)]
    assert stops, "the job must fail after --spare-wait, as with no spare host"
    assert "--spare-wait" in stops[0].why and "quarantined (health)" in stops[0].why
    assert "GPU 3 missing" in stops[0].why and "10.0.0.2" in stops[0].why


def test_a_readmitted_spare_host_takes_the_ranks() -> None:
    c, spares = formed_host_job(ready=2, spare_wait=30.0)
    c.health.expect(2)
    c.on_host_health(2, _report(False, "exit 1"), 101.5)
    _lose_host_1(c, 103.0)
    c.tick(103.0, 1e9)
    assert _assigned(c.drain()) == {}
    c.on_host_health(2, _report(True), 104.0)
    out = c.drain()
    assert _events(out, "host_readmitted") and _events(out, "host_health")[0]["ok"] is True
    c.on_agent_seen(0, 104.0)
    c.tick(104.0, 1e9)
    assert _assigned(c.drain()) == {2: spares[0], 3: spares[1]}


def test_a_host_whose_ranks_keep_faulting_is_quarantined() -> None:
    c, _ = formed_host_job(ready=2, host_fault_limit=2)
    ranks = {r: m.worker_id for r, m in c.ranks.items()}
    # rank 2 (host 1) faults at step 5; once its round formed, again at step 9
    c.ranks[2].step = 5
    c.on_exit(ranks[2], -9, False, "SIGKILL", "", 102.0, 1e9)
    c.tick(102.0, 1e9)
    assert not c.health.quarantined(1)
    moved = _assigned(c.drain())
    assert 2 in moved
    c.round = None  # (the round's progress is tested elsewhere)
    c.ranks[3].step = 9
    c.on_exit(ranks[3], -9, False, "SIGKILL", "", 103.0, 1e9)
    c.tick(103.0, 1e9)
    out = c.drain()
    assert c.health.quarantined(1)
    q = _events(out, "host_quarantined")
    assert q and q[0]["host"] == 1 and q[0]["reason"] == "faults", q


def test_one_machine_is_never_quarantined_for_faults() -> None:
    from tests.helpers.coordinator import new_coordinator

    c = new_coordinator(2, 1, host_fault_limit=1)
    c.start(0.0)
    c.drain()
    c.on_exit(0, -9, False, "SIGKILL", "", 1.0, 1e9)
    c.tick(1.0, 1e9)
    assert not c.health.quarantined(0)


def test_spares_of_a_host_quarantined_later_are_made_up_beside_the_ranks() -> None:
    c, spares = formed_host_job(ready=2)
    c.health.expect(2)
    c.on_host_health(2, _report(True), 101.5)
    c.drain()
    c.on_host_health(2, _report(False, "exit 1"), 102.0)
    out = c.drain()
    # the spare host's two spares stay (warm, for its re-admission), but no longer count: single
    # spares start beside the ranks, one per rank host, none on the quarantined host
    new = [x for x in out if type(x).__name__ == "Spawn"]
    assert sorted(getattr(x, "host", None) for x in new) == [0, 1], new
    assert all(w in c.procs for w in spares)


def test_a_host_that_failed_before_the_start_is_placed_as_a_spare_host() -> None:
    from checkpointless.coordinator.state import Spawn
    from checkpointless.settings import JobSettings
    from tests.helpers.coordinator import RENDEZVOUS, SCRIPT

    cfg = JobSettings(
        script=SCRIPT, nproc=4, spares=2, nnodes=2, nproc_per_node=2, spare_nodes=1, local_agent=False
    )  # fmt: skip
    c = Coordinator(cfg, "job", dict(RENDEZVOUS))
    for host in range(3):
        c.add_host(host, f"10.0.0.{host}", True, 100.0, host)  # host 0 would be node 0
        c.health.expect(host)
    c.on_host_health(0, _report(False, "exit 1"), 100.5)
    c.start(101.0)
    out = c.drain()
    placed = _events(out, "placement")[0]
    assert placed["spare_hosts"] == ["10.0.0.0"], placed
    assert {x.host for x in out if isinstance(x, Spawn)} == {1, 2}


def test_an_agent_lost_before_the_start_is_not_placed_and_its_rejoin_is_no_order_clash() -> None:
    # seen on a loaded machine: each agent's welcome came late, so it hung up and joined again as
    # a new agent with the same --node-order; the first joins' hosts were lost and must neither
    # be placed nor clash with the rejoined hosts' order hints
    from checkpointless.coordinator.state import Spawn
    from checkpointless.settings import JobSettings
    from tests.helpers.coordinator import RENDEZVOUS, SCRIPT

    cfg = JobSettings(
        script=SCRIPT, nproc=4, spares=2, nnodes=2, nproc_per_node=2, spare_nodes=1, local_agent=False
    )  # fmt: skip
    c = Coordinator(cfg, "job", dict(RENDEZVOUS))
    for host in range(3):
        c.add_host(host, f"10.0.0.{host}", True, 100.0, host)
    for host in range(3):
        c.on_host_lost(host, "its agent's connection closed", 100.1, 1e9)
    for host in range(3, 6):
        c.add_host(host, f"10.0.0.{host - 3}", True, 100.2, host - 3)
    c.start(101.0)
    out = c.drain()
    placed = _events(out, "placement")[0]
    assert placed["nodes"] == {"0": "10.0.0.0", "1": "10.0.0.1"} and placed["spare_hosts"] == ["10.0.0.2"], (
        placed
    )
    assert {x.host for x in out if isinstance(x, Spawn)} == {3, 4}
