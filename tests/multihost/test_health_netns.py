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

from tests.helpers.harness.netns_job import read_records, start_netns_job
from tests.helpers.jobs import TINY
from tests.helpers.paths import ROOT
from tests.helpers.reference import ReferenceRuns
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
    # steps enough to outlast the waits and the status command below (40 were over before host
    # 1 could be lost once the job's processes started without importing torch again); the job
    # fails --spare-wait after the loss, so they cost no time
    args = [*TINY[2:], "--steps", "400"]
    job = start_netns_job(cluster, run_dir, corpus, args, launcher_flags=flags)
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
def test_with_the_only_spare_host_quarantined_the_job_shrinks_instead_and_ends_bitwise(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """The same loss under ``--when-no-spare shrink``: the quarantined spare host is still never
    promoted (its agent starts no process), and the job goes on degraded instead (ranks 0 and 1
    hold the lost slots 2 and 3), every rank bitwise equal to the fault-free run and every
    (slot, step) on its batch."""
    ref = reference(4, script_args=ARGS)
    cluster = netns_hosts(3)
    sick = cluster.hosts[2].address
    run_dir = tmp_path / "job" / "run"
    deadline = time.monotonic() + 150
    flags = ["--health-check", _check_failing_on(sick), "--health-builtins", "basic"]
    flags += ["--when-no-spare", "shrink"]
    # a lease long enough that no host is taken for lost while the job starts on a loaded
    # machine (the killed host's agent is found by its closed connection, not the lease): a
    # host lost before the first generation has formed cannot be held degraded yet
    job = start_netns_job(cluster, run_dir, corpus, ARGS, launcher_flags=flags, lease=10.0)
    with job.killed_on_failure():
        wait_for(lambda: job.events("host_quarantined"), deadline, "the spare host's quarantine")
        job.wait_training(deadline, rank=2, step=3)
        assert cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
    res = job.finish(deadline)
    assert res.rc == 0, res.output[-4000:]
    (q,) = job.events("host_quarantined")
    assert q["address"] == sick, q
    # the quarantined host's agent started no process at all: no spare, no rank
    spawned = [e for e in read_records(run_dir / f"agent-{q['host']}.jsonl") if e["event"] == "spawn"]
    assert not spawned, f"the quarantined host started {spawned}"
    # the job shrank: ranks 0 and 1 held the lost slots; spares refilled on the surviving host
    # may take them back later (the pool refills on every healthy host)
    widths = [(e["width"], sorted(map(tuple, e["holders"]))) for e in res.of("width")]
    assert widths[0] == (2, [(2, 0), (3, 1)]), widths
    assert all(w == 4 and not h for w, h in widths[1:]), widths
    res.assert_same_weights(ref, nproc=4)
    res.assert_same_batches(ref)


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
        # host 1 is lost as soon as it trains, not after the health reports: its workers start
        # without waiting for them and may finish the job first, but the spare host's spares
        # take no rank before its report, so the promotion waits for the checks
        job.wait_training(deadline, rank=2, step=5)
        assert cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
    res = job.finish(deadline)
    assert res.rc == 0, res.output[-4000:]
    assert {2, 3} <= {e["rank"] for e in job.events("spare_assigned")}
    reports = {e["address"]: e for e in job.events("host_health")}
    spare = cluster.hosts[2].address
    first_report = min(e["time"] for e in job.events("host_health") if e["address"] == spare)
    promoted = min(e["time"] for e in job.events("spare_assigned"))
    assert first_report <= promoted, "a spare took a rank before its host's health report"
    assert reports[spare]["ok"] is True, reports
    checks = {c["name"]: c for c in reports[spare]["checks"]}
    assert {"memory", "room:/dev/shm", "room:run_dir", "collective", "cuda_matmul"} <= set(checks), checks
    assert checks["collective"]["ok"] and "127.0.0.1" in checks["collective"]["detail"], checks
    assert not job.events("host_quarantined")
    hosts = {h["address"]: h for h in _status(run_dir)["hosts"]}
    assert hosts[spare]["ok"] is True and hosts[spare]["quarantine"] == "", hosts
