"""Many hosts: a coordinator and one agent per host, each host a network namespace.

2 hosts x 2 ranks + 1 hot-spare host run the example; host 1 is lost mid-run (every process in
its namespace killed at once, or the host cut off the network) and its ranks move to the spare
host with state streamed from the replicas on host 0. The job must end bitwise identical to a
fault-free run (every rank's final weights and every committed batch), with nothing left behind.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import host_shm_dirs, launch_on_hosts
from tests.helpers.jobs import TINY, JobResult
from tests.helpers.reference import ReferenceRuns
from tests.helpers.wait import wait_for

ARGS = [*TINY[2:], "--steps", "40"]  # long enough to lose a host mid-run


def check_recovered(res: JobResult, ref: JobResult, lost_ranks: set[int]) -> None:
    """As tests/e2e/test_faults_e2e.py's check, for a host killed at an arbitrary moment: a rank of
    the lost host may have committed a step in the collective and died before its log line was
    written, so at most one committed batch per lost rank may be missing from the logs (its
    replica's line proves the same batch was trained). Every batch that is logged must match."""
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=len(ref.digests))
    res.assert_same_batches(ref, lost_ranks)
    assert res.of("recovery"), res.output[-6000:]
    assert not res.left_behind(), "processes of the job were left behind"
    shm = res.of("job_start")[0]["shm"]
    assert not Path(shm).exists(), "shared memory left behind"


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_host_loss_moves_its_ranks_to_the_spare_host(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, seconds=180)
    cluster = job.cluster
    job.wait_training(deadline)
    assert cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
    res = job.finish(deadline)
    check_recovered(res, ref, {2, 3})
    lost = job.events("host_lost")
    assert [e["ranks"] for e in lost] == [[2, 3]], lost
    moved = {e["rank"]: e["worker"] for e in job.events("spare_assigned")}
    # TODO: on a busy machine a first worker is sometimes judged wedged before it connects and
    # takes a spare at start (rank 0 below); then the lost node's ranks cannot all fit on host 2
    assert {2, 3} <= set(moved), moved
    # the spare host is whichever agent the placement made one (agents are numbered as they join)
    if sorted(moved) == [2, 3]:
        assert {moved[2], moved[3]} <= job.spare_host_spawns(), "the lost ranks must land on the spare host"
    rec = job.events("recovery")[-1]
    assert rec["transport"] == "stream", rec
    # the peer table went to each host's agent, once per version, and every worker read it there
    # (agent/tables.py): none whole to a member, none asked for
    plans = job.events("plan")
    assert all(p["peer_tables"]["members"] == 0 for p in plans), plans
    assert plans[0]["peer_tables"]["hosts"] >= 2 and plans[-1]["peer_tables"]["hosts"] == 1, plans
    assert not job.events("peer_table_request")


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_partitioned_host_is_fenced_and_rejoins_as_a_spare(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, seconds=180)
    cluster = job.cluster
    job.wait_training(deadline)
    h1 = cluster.hosts[1]
    h1.partition("both")
    wait_for(lambda: job.events("host_lost"), deadline, "the coordinator to declare host 1 lost")
    # the agent fences its host within its own lease: none of its workers is left
    wait_for(lambda: len(h1.pids()) <= 2, deadline, "host 1's workers to be killed by their agent")
    h1.heal()
    res = job.finish(deadline, lenient=[1])
    check_recovered(res, ref, {2, 3})
    lost = job.events("host_lost")
    assert [e["ranks"] for e in lost] == [[2, 3]], lost
    assert "lease" in lost[0]["why"], lost
    # a healed host that rejoined while the job ran came back as a spare host, not as ranks 2-3
    rejoined = [e for e in job.events("host_joined") if e["spare"]]
    for e in rejoined:
        assert e["host"] >= 3, e
    moved = {e["rank"] for e in job.events("spare_assigned")}
    assert {2, 3} <= moved, moved  # (rank 0 too when judged wedged at start: see the TODO above)


@pytest.mark.netns
@pytest.mark.timeout(240)
# inbound under `make soak` (the outbound case, in `make test`, fences the same way; kept under
# the ~20 min aim)
@pytest.mark.parametrize("direction", [pytest.param("in", marks=pytest.mark.soak), "out"])
def test_a_one_way_partition_is_fenced_too(
    netns_hosts: Any, tmp_path: Path, corpus: Path, direction: str, reference: ReferenceRuns
) -> None:
    """Host 1 hears but cannot speak ("out"), or speaks but cannot hear ("in"): either way its
    workers must stop within a lease, its ranks move to the spare host, and the job ends bitwise.
    Its agent, told not to rejoin, leaves nothing of the job in its host's shared memory."""
    ref = reference(4, script_args=ARGS)
    with host_shm_dirs(3) as shm:
        job, deadline = launch_on_hosts(
            netns_hosts, tmp_path, corpus, ARGS, seconds=180, shm_dirs=shm, agent_flags=["--no-rejoin"]
        )
        job.wait_training(deadline)
        h1 = job.cluster.hosts[1]
        assert list(shm[1].iterdir()), "host 1 holds none of the job's shared memory to clean up"
        h1.partition(direction)  # type: ignore[arg-type]
        cut = time.monotonic()
        wait_for(lambda: len(h1.pids()) <= 2, deadline, "host 1's workers to be stopped")
        # within a lease of noticing (3 s here), plus the noticing, on a busy machine
        assert time.monotonic() - cut < 20, "host 1's workers outlived the lease"
        wait_for(lambda: job.agents[1].poll() is not None, deadline, "host 1's fenced agent to exit")
        assert job.agents[1].returncode == 1, job.agents[1].returncode
        assert not list(shm[1].iterdir()), "the fenced agent left the job's shared memory behind"
        h1.heal()
        res = job.finish(deadline)
    check_recovered(res, ref, {2, 3})
    moved = {e["rank"] for e in job.events("spare_assigned")}
    assert {2, 3} <= moved, moved


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_after_a_host_loss_a_process_fault_is_still_recovered(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """Host 1 is lost and its ranks use up the spare host; the spares refilled beside the ranks
    then replace a SIGKILLed rank on host 0, and the job still ends bitwise."""
    args = [*TINY[2:], "--steps", "160"]  # room for a refill spare to start after the host loss
    ref = reference(4, script_args=args)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, args, seconds=240)
    cluster = job.cluster
    job.wait_training(deadline)
    assert cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
    wait_for(lambda: job.events("recovery"), deadline, "the host loss to be recovered")
    conds = [e for e in job.events("condition") if e["name"] == "no_spare_host"]
    assert conds and conds[0]["active"], conds
    # a spare beside ranks 0-1 on host 0 is started, and says it is ready
    h0 = cluster.hosts[0].address

    def beside() -> list[int]:
        spawned = [e["worker"] for e in job.agent_events(h0, "spawn") if e["role"] == "spare"]
        return [w for w in spawned if w in {e["worker"] for e in job.events("spare_ready")}]

    wait_for(beside, deadline, "a spare beside host 0's ranks to be ready")
    spare = beside()[0]
    holder = {e["rank"]: e["worker"] for e in job.events("spare_assigned")}.get(0, 0)
    pid = next(e["pid"] for e in job.agent_events(h0, "spawn") if e["worker"] == holder)
    before = job.committed(0)
    os.kill(pid, signal.SIGKILL)
    res = job.finish(deadline)
    check_recovered(res, ref, {0, 2, 3})
    assert job.committed(0) > before
    faults = [(e["rank"], e["kind"]) for e in job.events("fault")]
    assert (0, "killed") in faults, faults
    took = [e["worker"] for e in job.events("spare_assigned") if e["rank"] == 0]
    assert took and took[-1] == spare, (took, spare)  # host 0's own spare took its rank
    assert len(job.events("recovery")) >= 2
