"""The goodput ledger, the checkpoint-restart estimate and the status view as pure functions of
event records (no processes): the buckets add up to the wall time, a recovery's phases are the
recovery event's own, and a running, finished or orphaned job each reads as what it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.observe.compare import estimate_restart
from checkpointless.observe.ledger import BUCKETS, build_ledger
from checkpointless.observe.status import build_status

T0 = 1000.0


def _job(
    faults: list[tuple[float, float, float]], end: float | None = 60.0, steps: int = 100
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two ranks at 0.1 s a step from t=10; each fault is (detected_at, detect_s, spare_wait)."""
    ev: list[dict[str, Any]] = [
        {"time": T0, "event": "job_start", "job": "j", "nproc": 2, "spares": 1, "pid": 11, "host": "h"},
        {"time": T0 + 0.1, "event": "spawn", "worker": 0, "role": "worker", "pid": 100},
        {"time": T0 + 0.1, "event": "spawn", "worker": 1, "role": "worker", "pid": 101},
        {"time": T0 + 10, "event": "started", "generation": 0, "seconds": 10},
        {"time": T0 + 10.5, "event": "spawn", "worker": 2, "role": "spare", "pid": 102},
        {"time": T0 + 12, "event": "spare_ready", "worker": 2},
    ]
    commits: list[dict[str, Any]] = []
    t, step, gen = T0 + 10, 0, 0
    pending = sorted(faults)
    while step < steps and (end is None or t + 0.1 < T0 + end):
        if pending and t + 0.1 > T0 + pending[0][0]:
            at, detect, wait = pending.pop(0)
            gen += 1
            fault_t = T0 + at
            ev.append(
                {
                    "time": fault_t,
                    "event": "fault",
                    "rank": 1,
                    "kind": "killed",
                    "generation": gen - 1,
                    "step": step,
                }
            )
            ev.append(
                {"time": fault_t + wait, "event": "spare_assigned", "rank": 1, "worker": 2, "generation": gen}
            )
            phases = {"collect_s": wait + 0.2, "rebuild_s": 0.3, "transfer_s": 0.4, "first_batch_s": 0.01}
            phases["first_step_s"] = 0.15
            downtime = sum(phases.values()) + 0.05
            ev.append(
                {
                    "time": fault_t + downtime,
                    "event": "recovery",
                    "generation": gen,
                    "faults": [{"time": fault_t, "rank": 1, "kind": "killed"}],
                    "downtime_s": downtime,
                    "detect_s": detect,
                    "state_bytes": 5e6,
                    **phases,
                }
            )
            t = fault_t + downtime
            for r in range(2):
                commits.append({"time": t, "event": "commit", "rank": r, "step": step, "generation": gen})
            step += 1
            continue
        t += 0.1
        for r in range(2):
            commits.append({"time": t, "event": "commit", "rank": r, "step": step, "generation": gen})
        step += 1
    if end is not None:
        ev.append({"time": T0 + end, "event": "job_end", "status": "ok", "recoveries": len(faults)})
    return ev, commits


def test_buckets_add_up_to_wall_time_and_phases_are_the_events() -> None:
    ev, commits = _job([(20.0, 1.5, 0.0), (30.0, 0.02, 2.0)], steps=10_000)
    led = build_ledger(ev, commits)
    assert led.status == "ok" and led.wall_s == pytest.approx(60.0)
    assert set(led.totals) == set(BUCKETS)
    assert sum(led.totals.values()) == pytest.approx(led.wall_s)
    assert led.totals["startup"] == pytest.approx(10.0)
    assert len(led.faults) == 2
    recs = [e for e in ev if e["event"] == "recovery"]
    for f, rec in zip(led.faults, recs, strict=True):
        assert f.phases["detection"] == pytest.approx(rec["detect_s"])
        assert f.phases["rebuild"] == pytest.approx(rec["rebuild_s"])
        assert f.phases["transfer"] == pytest.approx(rec["transfer_s"])
        assert f.phases["abort"] + f.phases["spare_wait"] == pytest.approx(rec["collect_s"])
        assert f.phases["first_step"] == pytest.approx(rec["first_batch_s"] + rec["first_step_s"])
        # everything after detection is the launcher's downtime, to the microsecond
        after = sum(v for k, v in f.phases.items() if k not in ("detection", "replayed"))
        assert after == pytest.approx(rec["downtime_s"])
    assert led.faults[1].phases["spare_wait"] == pytest.approx(2.0)
    assert led.step_time_s == pytest.approx(0.1)
    assert led.totals["spare_wait"] == pytest.approx(2.0)


def test_running_job_is_charged_up_to_now_and_an_open_fault_is_unrecovered() -> None:
    ev, commits = _job([], end=None, steps=50)
    ev.append({"time": T0 + 16, "event": "fault", "rank": 0, "kind": "hang", "generation": 0, "step": 50})
    led = build_ledger(ev, commits, now=T0 + 20)
    assert led.status == "running" and led.end == T0 + 20
    assert led.totals["unrecovered"] == pytest.approx(4.0)
    assert sum(led.totals.values()) == pytest.approx(20.0)
    assert not led.faults[-1].recovered
    # the launcher was killed: no "now", the job ends at the last record anyone wrote
    gone = build_ledger(ev, commits)
    assert gone.status == "launcher gone" and gone.end == T0 + 16


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(12, 50), st.floats(0, 3), st.floats(0, 3)),
        max_size=4,
        unique_by=lambda f: round(f[0]),
    )
)
def test_totals_always_add_up(faults: list[tuple[float, float, float]]) -> None:
    ev, commits = _job(faults, end=80.0, steps=10_000)
    led = build_ledger(ev, commits)
    assert sum(led.totals.values()) == pytest.approx(led.wall_s, abs=1e-6)
    assert all(v >= -1e-9 for v in led.totals.values()), led.totals
    assert all(s.end > s.start for s in led.segments)
    assert all(a.end <= b.start + 1e-9 for a, b in zip(led.segments, led.segments[1:], strict=False))


def test_restart_estimate_charges_each_fault_a_restart_and_lost_work() -> None:
    ev, commits = _job([(20.0, 0.02, 0.0)])
    led = build_ledger(ev, commits)
    est = estimate_restart(led)
    assert est is not None
    restart = sum(est.phases.values())
    assert restart > 5.0  # process start and imports dominate on one machine
    assert est.per_fault_s[0] == pytest.approx(0.6103 + restart + est.lost_work_s)
    assert est.wall_s > led.wall_s and est.goodput < led.goodput
    fixed = estimate_restart(led, interval_steps=10)
    assert fixed is not None and fixed.lost_work_s == pytest.approx(0.5)


def test_status_of_running_finished_and_orphaned_jobs() -> None:
    ev, commits = _job([(20.0, 0.02, 0.0)], end=None, steps=200)
    live = {11, 100, 101, 102}
    st_run = build_status("d", ev, commits, now=T0 + 40, alive=lambda p: p in live)
    assert st_run.state == "running" and st_run.recoveries == 1 and st_run.faults == 1
    assert [r.state for r in st_run.ranks] == ["training", "training"]
    assert st_run.ranks[1].worker == 2 and st_run.ranks[1].pid == 102  # the spare took rank 1
    assert st_run.ranks[0].step_time_s == pytest.approx(0.1)
    assert st_run.spares == []  # the only spare was assigned
    gone = build_status("d", ev, commits, now=T0 + 40, alive=lambda p: p != 11)
    assert gone.state == "launcher gone" and gone.ranks[0].state == "orphaned"
    dead = build_status("d", ev, commits, now=T0 + 40, alive=lambda p: False)
    assert dead.state == "launcher gone" and {r.state for r in dead.ranks} == {"dead"}
    ev_done, commits_done = _job([(20.0, 0.02, 0.0)])
    done = build_status("d", ev_done, commits_done, now=T0 + 99, alive=lambda p: False)
    assert done.state == "finished" and done.elapsed_s == pytest.approx(60.0)
    assert "secret" not in repr(done)


@pytest.mark.timeout(60)
def test_timeline_png_has_a_breakdown_row_per_recovery(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from checkpointless.observe.timeline import write_timeline

    heights = {}
    for n in (0, 1, 3):
        ev, commits = _job([(20.0 + 5 * i, 0.4, 0.0) for i in range(n)], steps=10_000)
        ledger = build_ledger(ev, commits)
        assert len(ledger.faults) == n
        png = tmp_path / f"t{n}.png"
        write_timeline(ledger, ev, commits, png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        heights[n] = imread(png).shape[0]
    # no recovery: no breakdown panel; each recovery adds one row to it
    assert heights[0] < heights[1] < heights[3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t0.png", "t1.png", "t3.png"]  # no temporary left
