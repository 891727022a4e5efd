"""Coordinator failover across hosts (network namespaces): the coordinator is lost mid-run, the
agents elect a successor by majority, it rebuilds the state from their reports and the workers'
reconnects, and the job ends bitwise identical to a fault-free run, with nothing left behind.

Layout as in tests/test_multihost.py and the README's Slurm script: the coordinator on host 0
next to that host's agent, 2 hosts x 2 ranks + 1 spare host.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.hosts import NetnsCluster
from jobs import ROOT, JobResult, read_digests
from test_multihost import ARGS, _committed, _events, _reference, _wait_for, check_recovered

CONTROL_PORT = 29400


def _start(cluster: NetnsCluster, run_dir: Path, corpus: Path, lease: float = 5.0) -> list[Any]:
    """As tests/test_multihost.py: the coordinator on host 0, then an agent on every host. The
    lease is longer than there (5 s): on busy cores an agent starting its fork template was
    sometimes silent for 3 s, and a host lost at start-up is not what these tests are about."""
    h0 = cluster.hosts[0]
    py = [sys.executable, "-m", "checkpointless"]
    digest = run_dir.parent / (run_dir.name + ".digest-{rank}")
    coord = [
        *py, "coordinator",
        "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
        "--host", h0.address, "--control-port", str(CONTROL_PORT),
        "--run-dir", str(run_dir), "--hang-timeout", "20", "--lease", str(lease),
        str(ROOT / "examples" / "train_gpt.py"), *ARGS,
        "--data", str(corpus), "--digest-out", str(digest),
    ]  # fmt: skip
    log = open(run_dir.parent / "coordinator.out", "wb")  # noqa: SIM115 (lives as long as the job)
    procs = [h0.popen(coord, cwd=ROOT, stdout=log, stderr=log)]
    for i, h in enumerate(cluster.hosts):
        agent = [
            *py, "agent", "--coordinator", f"{h0.address}:{CONTROL_PORT}", "--host", h.address,
            "--secret-file", str(run_dir / "secret"), "--node-order", str(i),
        ]  # fmt: skip
        out = open(run_dir.parent / f"agent-{i}.out", "wb")  # noqa: SIM115
        procs.append(h.popen(agent, cwd=ROOT, stdout=out, stderr=out))
    return procs


def _finish_agents(
    procs: list[Any], run_dir: Path, deadline: float, lenient: set[int] = frozenset()
) -> JobResult:
    """The job ends in the agent that took over: its exit code is the job's. Agents in
    ``lenient`` (a fenced host's, which may still be trying to rejoin) are stopped once the
    others are done, and their exit code does not count."""
    codes = []
    for i, p in enumerate(procs[1:], start=1):
        if i in lenient:
            continue
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            p.kill()
            p.wait(timeout=10)
        codes.append(p.returncode)
    for i in lenient:
        try:
            procs[i].wait(timeout=5)
        except Exception:
            procs[i].kill()  # it is waiting to rejoin a coordinator that has gone; nothing to save
            procs[i].wait(timeout=10)
    out = (run_dir.parent / "coordinator.out").read_text(errors="replace")[-3000:]
    for i in range(3):
        out += f"\n--- agent {i}\n" + (run_dir.parent / f"agent-{i}.out").read_text(errors="replace")[-6000:]
    digests = read_digests(run_dir.parent, run_dir.name + ".digest-")
    rc = 0 if all(c == 0 for c in codes) else max(codes, key=lambda c: c != 0)
    return JobResult(rc, out + f"\nagent exit codes {codes}", run_dir, digests)


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_killed_coordinator_is_replaced_and_the_job_finishes_bitwise(
    netns_hosts: Any, tmp_path: Path, corpus: Path
) -> None:
    ref = _reference(tmp_path / "ref", corpus)
    cluster = netns_hosts(3)
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    deadline = time.monotonic() + 200
    procs = _start(cluster, run_dir, corpus)
    try:
        _wait_for(lambda: _committed(run_dir, 2) >= 5, deadline, "rank 2 (host 1) to commit step 5")
        _wait_for(lambda: len(_events(run_dir, "host_joined")) >= 3, deadline, "every agent to join")
        step_at_kill = _committed(run_dir, 0)
        procs[0].kill()  # SIGKILL: the coordinator process only; every agent and worker lives on
        killed = time.monotonic()
        procs[0].wait(timeout=10)
        _wait_for(lambda: _events(run_dir, "coordinator_failover"), killed + 30, "a new coordinator")
        elected_in = time.monotonic() - killed
        _wait_for(
            lambda: _committed(run_dir, 0) > step_at_kill + 1, deadline, "a step committed after the failover"
        )
    except BaseException:
        for p in procs:
            p.kill()
        raise
    res = _finish_agents(procs, run_dir, deadline)
    assert res.rc == 0, res.output
    check_recovered(res, ref, set())
    fo = _events(run_dir, "coordinator_failover")
    assert len(fo) == 1, fo
    ev = fo[0]
    assert ev["term"] >= 1 and ev["old"].endswith(":29400"), ev
    assert len(ev["voters"]) >= 2 and ev["missing"] == [] and ev["ranks"] == 4, ev
    assert elected_in < 15, f"a new coordinator took {elected_in:.1f} s"
    assert _events(run_dir, "coordinator_resumed"), "no committed step after the takeover"
    ends = _events(run_dir, "job_end")
    assert [e["status"] for e in ends] == ["ok"], ends


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_partition_isolating_the_coordinator_elects_a_successor_on_the_majority_side(
    netns_hosts: Any, tmp_path: Path, corpus: Path
) -> None:
    """Host 0 (the coordinator and node 0's agent with ranks 0-1) is cut off: the coordinator
    steps down, host 0's agent fences its workers, the two other hosts elect a successor, ranks
    0-1 move to the spare host with state from ranks 2-3, and the job ends bitwise."""
    ref = _reference(tmp_path / "ref", corpus)
    cluster = netns_hosts(3)
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    deadline = time.monotonic() + 200
    procs = _start(cluster, run_dir, corpus)
    h0 = cluster.hosts[0]
    try:
        _wait_for(lambda: _committed(run_dir, 2) >= 5, deadline, "rank 2 (host 1) to commit step 5")
        _wait_for(lambda: len(_events(run_dir, "host_joined")) >= 3, deadline, "every agent to join")
        h0.partition("both")
        cut = time.monotonic()
        _wait_for(
            lambda: _events(run_dir, "coordinator_failover"), cut + 40, "a successor on the majority side"
        )
        _wait_for(lambda: procs[0].poll() is not None, cut + 30, "the isolated coordinator to step down")
        # host 0's agent fences its workers: none of ranks 0-1's processes is left there
        _wait_for(lambda: len(h0.pids()) <= 2, cut + 30, "host 0's workers to be killed by their agent")
        fenced_in = time.monotonic() - cut
        h0.heal()
    except BaseException:
        for p in procs:
            p.kill()
        raise
    res = _finish_agents(procs, run_dir, deadline, lenient={1})
    assert res.rc == 0, res.output
    check_recovered(res, ref, {0, 1})
    assert procs[0].returncode == 75, res.output  # stepped down, did not end the job
    assert _events(run_dir, "coordinator_step_down"), "the isolated coordinator did not step down"
    ev = _events(run_dir, "coordinator_failover")[0]
    assert ev["missing"] == [0, 1] and len(ev["voters"]) == 2, ev
    assert fenced_in < 25, f"host 0 was fenced only after {fenced_in:.1f} s"
    moved = {e["rank"] for e in _events(run_dir, "spare_assigned")}
    assert {0, 1} <= moved, moved
    ends = _events(run_dir, "job_end")
    assert [e["status"] for e in ends] == ["ok"], ends


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_coordinator_host_lost_whole_the_others_elect_and_recover_its_ranks(
    netns_hosts: Any, tmp_path: Path, corpus: Path
) -> None:
    """Every process on host 0 dies at once (the coordinator, node 0's agent, ranks 0-1): the two
    other agents elect a successor, ranks 0-1 move to the spare host, bitwise."""
    ref = _reference(tmp_path / "ref", corpus)
    cluster = netns_hosts(3)
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    deadline = time.monotonic() + 200
    procs = _start(cluster, run_dir, corpus)
    try:
        _wait_for(lambda: _committed(run_dir, 2) >= 5, deadline, "rank 2 (host 1) to commit step 5")
        _wait_for(lambda: len(_events(run_dir, "host_joined")) >= 3, deadline, "every agent to join")
        assert cluster.hosts[0].kill_all(), "host 0 had no processes to kill"
        killed = time.monotonic()
        _wait_for(lambda: _events(run_dir, "coordinator_failover"), killed + 30, "a new coordinator")
        elected_in = time.monotonic() - killed
    except BaseException:
        for p in procs:
            p.kill()
        raise
    res = _finish_agents(procs, run_dir, deadline, lenient={1})
    assert res.rc == 0, res.output
    check_recovered(res, ref, {0, 1})
    ev = _events(run_dir, "coordinator_failover")[0]
    assert ev["missing"] == [0, 1] and len(ev["voters"]) == 2, ev
    assert elected_in < 15, f"a new coordinator took {elected_in:.1f} s"
    assert {0, 1} <= {e["rank"] for e in _events(run_dir, "spare_assigned")}
    ends = _events(run_dir, "job_end")
    assert [e["status"] for e in ends] == ["ok"], ends
