"""Health-gated admission across hosts (network namespaces; issue 39, part 3): every agent checks
its host as it joins and reports to the coordinator; a spare host whose check fails is
quarantined and never promoted.

Layout as in tests/multihost/test_multihost.py: the coordinator on host 0, 2 hosts x 2 ranks and
a spare host (host 2). The operator's check (``--health-check``) fails on host 2 only: it
compares the address its agent serves (``$CHECKPOINTLESS_HOST``, in the environment every check
gets) with host 2's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import start_netns_job
from tests.helpers.jobs import TINY
from tests.helpers.paths import ROOT
from tests.helpers.wait import wait_for

ARGS = [*TINY[2:], "--steps", "40"]
SICK = "host marked unhealthy by the test"


def _check_failing_on(address: str) -> str:
    return f'test "$CHECKPOINTLESS_HOST" != {address} || {{ echo "{SICK}"; exit 1; }}'


def _status(run_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "checkpointless", "status", "--json", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    )
    status: dict[str, Any] = json.loads(out.stdout)
    return status


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_a_spare_host_that_fails_its_check_is_never_promoted(
    netns_hosts: Any, tmp_path: Path, corpus: Path
) -> None:
    """Host 1 is lost; the only spare host is quarantined, so its ranks have nowhere to go: the job
    waits --spare-wait and fails (``--when-no-spare fail``; the default would go on degraded after
    the wait), naming the quarantine and the check's output."""
    cluster = netns_hosts(3)
    sick = cluster.hosts[2].address
    run_dir = tmp_path / "job" / "run"
    deadline = time.monotonic() + 150
    flags = ["--health-check", _check_failing_on(sick), "--health-builtins", "basic", "--spare-wait", "4"]
    flags += ["--when-no-spare", "fail"]
    job = start_netns_job(cluster, run_dir, corpus, ARGS, launcher_flags=flags)
    with job.killed_on_failure():
        wait_for(lambda: job.events("host_quarantined"), deadline, "the spare host's quarantine")
        job.wait_training(deadline, rank=2, step=3)
        st = _status(run_dir)
        hosts = {h["address"]: h for h in st["hosts"]}
        assert hosts[sick]["quarantine"] == "health" and SICK in hosts[sick]["detail"], hosts
        assert all(h["ok"] for a, h in hosts.items() if a != sick), hosts
        assert cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
    res = job.finish(deadline)
    assert res.rc != 0, res.output[-4000:]
    q = job.events("host_quarantined")
    assert [(e["address"], e["reason"]) for e in q] == [(sick, "health")], q
    assert SICK in q[0]["detail"] and "exit 1" in q[0]["detail"], q
    moved = {e["rank"] for e in job.events("spare_assigned")}
    assert not moved & {2, 3}, f"a spare of the quarantined host took ranks {moved}"
    end = job.events("job_end")[-1]
    assert end["status"] == "failed", end
    assert "--spare-wait" in end["error"] and "quarantined (health)" in end["error"], end
    assert sick in end["error"] and SICK in end["error"], end


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_a_healthy_spare_host_is_promoted_after_its_checks_pass(
    netns_hosts: Any, tmp_path: Path, corpus: Path
) -> None:
    """Every built-in check (the loopback gloo all-reduce in a child process included) and the
    operator's check pass on every host: the spare host takes the lost host's ranks as before, and
    its health is in the events and in ``checkpointless status``."""
    cluster = netns_hosts(3)
    run_dir = tmp_path / "job" / "run"
    deadline = time.monotonic() + 150
    elsewhere = "10.255.255.254"  # no host has it: the operator's check passes everywhere
    flags = ["--health-check", _check_failing_on(elsewhere)]
    job = start_netns_job(cluster, run_dir, corpus, ARGS, launcher_flags=flags)
    with job.killed_on_failure():
        wait_for(lambda: len(job.events("host_health")) >= 3, deadline, "every agent's health report")
        job.wait_training(deadline, rank=2, step=5)
        assert cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
    res = job.finish(deadline)
    assert res.rc == 0, res.output[-4000:]
    assert {2, 3} <= {e["rank"] for e in job.events("spare_assigned")}
    reports = {e["address"]: e for e in job.events("host_health")}
    spare = cluster.hosts[2].address
    assert reports[spare]["ok"] is True, reports
    checks = {c["name"]: c for c in reports[spare]["checks"]}
    assert {"memory", "room:/dev/shm", "room:run_dir", "collective", "cuda_matmul"} <= set(checks), checks
    assert checks["collective"]["ok"] and "127.0.0.1" in checks["collective"]["detail"], checks
    assert not job.events("host_quarantined")
    hosts = {h["address"]: h for h in _status(run_dir)["hosts"]}
    assert hosts[spare]["ok"] is True and hosts[spare]["quarantine"] == "", hosts
