"""status and the metrics show the job's width (issue 39, degraded mode): --nproc at full width,
the live replicas and the held slots while degraded, full again once it grows back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.status import build_status, render_status

pytestmark = pytest.mark.timeout(60)

T0 = 1_000.0


def _events() -> list[dict[str, Any]]:
    return [
        {"event": "job_start", "time": T0, "job": "j", "nproc": 4, "host": "h", "pid": 11},
        {"event": "width", "time": T0 + 1, "generation": 1, "width": 3, "slots": 4, "holders": [[2, 0]]},
    ]


def test_status_says_degraded_with_the_held_slots_then_full() -> None:
    ev = _events()
    st = build_status("d", ev[:1], [], now=T0 + 1, alive=lambda p: True)
    assert (st.width, st.held) == (4, []) and "DEGRADED" not in render_status(st)
    st = build_status("d", ev, [], now=T0 + 2, alive=lambda p: True)
    assert (st.width, st.held) == (3, [[2, 0]])
    assert "DEGRADED: 3 of 4 replicas; held slots (slot, holder rank): [[2, 0]]" in render_status(st)
    ev.append({"event": "width", "time": T0 + 3, "generation": 2, "width": 4, "slots": 4, "holders": []})
    st = build_status("d", ev, [], now=T0 + 4, alive=lambda p: True)
    assert (st.width, st.held) == (4, []) and "DEGRADED" not in render_status(st)


def test_metrics_gauge_the_live_replicas(tmp_path: Path) -> None:
    jm = JobMetrics(tmp_path)
    try:
        ev = _events()
        jm.on_event(ev[0])
        jm.pump(tmp_path / "rank-0.jsonl")
        assert "checkpointless_replicas 4.0" in generate_latest(jm.registry).decode()
        jm.on_event(ev[1])
        jm.pump(tmp_path / "rank-0.jsonl")
        assert "checkpointless_replicas 3.0" in generate_latest(jm.registry).decode()
    finally:
        jm.close()
