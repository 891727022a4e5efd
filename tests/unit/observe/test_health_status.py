"""Host health in ``checkpointless status`` and the Prometheus metrics: built from the
coordinator's host_health, host_quarantined and host_readmitted events (coordinator/health.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.status import HostHealthStatus, build_status, render_status

pytestmark = pytest.mark.timeout(60)

T0 = 1_000.0
SICK = "command:/opt/check.sh: exit 1: GPU 3 missing"


def _events() -> list[dict[str, Any]]:
    return [
        {"event": "job_start", "time": T0, "job": "j", "nproc": 2, "host": "10.0.0.1", "pid": 11},
        {"event": "host_health", "time": T0 + 1, "host": 1, "address": "10.0.0.2", "ok": True, "detail": ""},
        {"event": "host_health", "time": T0 + 1, "host": 2, "address": "10.0.0.3", "ok": False, "detail": SICK},
        {"event": "host_quarantined", "time": T0 + 1, "host": 2, "address": "10.0.0.3", "reason": "health", "detail": SICK},
        {"event": "host_health", "time": T0 + 2, "host": 3, "address": "10.0.0.4", "ok": False, "detail": "x"},
        {"event": "host_quarantined", "time": T0 + 2, "host": 3, "address": "10.0.0.4", "reason": "health", "detail": "x"},
    ]  # fmt: skip


def test_status_lists_each_hosts_health_and_quarantine() -> None:
    ev = _events()
    st = build_status("d", ev, [], now=T0 + 5, alive=lambda p: True)
    assert st.hosts == [
        HostHealthStatus(1, "10.0.0.2", True, "", ""),
        HostHealthStatus(2, "10.0.0.3", False, "health", SICK),
        HostHealthStatus(3, "10.0.0.4", False, "health", "x"),
    ]
    text = render_status(st)
    assert "host health: 1 admitted, 2 quarantined" in text
    assert f"10.0.0.3 (agent 2) QUARANTINED (health): {SICK}" in text
    ev += [
        {"event": "host_health", "time": T0 + 9, "host": 2, "address": "10.0.0.3", "ok": True, "detail": ""},
        {"event": "host_readmitted", "time": T0 + 9, "host": 2, "address": "10.0.0.3", "reason": "health"},
        {"event": "host_lost", "time": T0 + 9, "host": 3, "address": "10.0.0.4", "why": "lease"},
    ]
    st = build_status("d", ev, [], now=T0 + 10, alive=lambda p: True)
    assert [(h.host, h.ok, h.quarantine) for h in st.hosts] == [(1, True, ""), (2, True, "")]
    assert "host health: 2 admitted, 0 quarantined" in render_status(st)
    assert "host health" not in render_status(build_status("d", ev[:1], [], now=T0, alive=lambda p: True))


def test_metrics_count_quarantined_hosts_with_a_gauge_per_host(tmp_path: Path) -> None:
    jm = JobMetrics(tmp_path)
    for e in _events():
        jm.on_event(e)
    jm.pump(tmp_path / "rank-0.jsonl")
    text = generate_latest(jm.registry).decode()
    assert "checkpointless_hosts_quarantined 2.0" in text
    assert 'checkpointless_host_quarantined{address="10.0.0.3",host="2",reason="health"} 1.0' in text
    assert 'checkpointless_host_health_ok{address="10.0.0.2",host="1"} 1.0' in text
    assert 'checkpointless_host_health_ok{address="10.0.0.3",host="2"} 0.0' in text
    jm.on_event(
        {"event": "host_readmitted", "time": T0 + 9, "host": 2, "address": "10.0.0.3", "reason": "health"}
    )
    jm.on_event({"event": "host_lost", "time": T0 + 9, "host": 3, "address": "10.0.0.4", "why": "lease"})
    jm.pump(tmp_path / "rank-0.jsonl")
    text = generate_latest(jm.registry).decode()
    assert "checkpointless_hosts_quarantined 0.0" in text
    assert "checkpointless_host_quarantined{" not in text
    assert 'host="3"' not in text
    jm.close()
