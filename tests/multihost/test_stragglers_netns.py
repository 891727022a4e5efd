"""A straggler host, for real: 2 hosts x 2 ranks + 1 spare host in network namespaces, and host 1's
workers throttled by the kernel (a CPU cgroup with a small quota: what a throttled or shared host
looks like). The coordinator must name host 1 in a ``straggler`` event, and with
``--swap-stragglers`` move ranks 2 and 3 to the spare host; the job still ends bitwise identical to
a fault-free run."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import launch_on_hosts
from tests.helpers.reference import ReferenceRuns
from tests.helpers.wait import wait_for
from tests.multihost.test_multihost import ARGS, check_recovered

_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")


def _cgroup_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make a CPU cgroup"
    if (_V1 / "cpu.cfs_quota_us").exists() or "cpu" in _read(_V2 / "cgroup.subtree_control").split():
        return None
    return "no CPU cgroup controller (cgroup v1 cpu or v2 cpu in subtree_control) to throttle a host with"


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


@contextmanager
def cpu_throttle(pids: list[int], share: float) -> Iterator[None]:
    """Hold ``pids`` (with all their threads) to ``share`` of one CPU together; removed after."""
    name = f"cplh-slow-{os.getpid()}-{secrets.token_hex(3)}"
    # a short period: every stretch of computing is slowed alike. With 100 ms, a step of ~20 ms
    # of work ran at full speed until the quota ran out and then stalled 90 ms wherever it was,
    # often waiting in an all-reduce, which counts as waiting, not as busy: in one CI run no
    # straggler was seen in 31 throttled steps
    period = 10_000
    quota = max(1000, int(share * period))
    if (_V1 / "cpu.cfs_quota_us").exists():
        d = _V1 / name
        d.mkdir()
        (d / "cpu.cfs_period_us").write_text(str(period))
        (d / "cpu.cfs_quota_us").write_text(str(quota))
        parent = _V1
    else:
        d = _V2 / name
        d.mkdir()
        (d / "cpu.max").write_text(f"{quota} {period}")
        parent = _V2
    try:
        for pid in pids:
            try:
                (d / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it exited meanwhile
        yield
    finally:
        # a cgroup can only be removed once empty: hand whatever is left back to the root
        for line in _read(d / "cgroup.procs").split():
            try:
                (parent / "cgroup.procs").write_text(line)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while True:
            try:
                d.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_a_throttled_host_is_reported_and_swapped_for_the_spare_host(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    why = _cgroup_unavailable()
    if why:
        pytest.skip(why)
    ref = reference(4, script_args=ARGS)
    flags = ["--straggler-ratio", "1.5", "--straggler-window", "4", "--swap-stragglers"]
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, seconds=240, launcher_flags=flags)
    cluster = job.cluster
    job.wait_training(deadline, step=3)
    assert not job.events("straggler"), "equal hosts must not be reported"
    agent1 = job.agents[1].pid
    workers = [p for p in cluster.hosts[1].pids() if p != agent1]
    with cpu_throttle(workers, share=0.1):
        wait_for(lambda: job.events("straggler_swap"), deadline, "host 1 to be swapped out")
    # the swapped host is fenced like a lost one; its agent may still be trying to rejoin
    res = job.finish(deadline, lenient=[1])
    check_recovered(res, ref, {2, 3})
    slow = job.events("straggler")
    assert slow and slow[0]["address"] == cluster.hosts[1].address and slow[0]["ranks"] == [2, 3], slow
    assert slow[0]["ratio"] >= 1.5 and len(slow[0]["window"]) == 4, slow
    assert [e["ranks"] for e in job.events("host_lost")] == [[2, 3]]
    moved = {e["rank"]: e["worker"] for e in job.events("spare_assigned")}
    assert {2, 3} <= set(moved), moved
    assert {moved[2], moved[3]} <= job.spare_host_spawns(), (
        "the slow host's ranks must land on the spare host"
    )
