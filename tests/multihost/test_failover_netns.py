"""Coordinator failover across hosts (network namespaces): the coordinator is lost mid-run, the
agents elect a successor by majority, it rebuilds the state from their reports and the workers'
reconnects, and the job ends bitwise identical to a fault-free run, with nothing left behind.

Layout as in tests/multihost/test_multihost.py and the README's Slurm script: the coordinator on host 0
next to that host's agent, 2 hosts x 2 ranks + 1 spare host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import launch_on_hosts
from tests.helpers.jobs import TINY
from tests.helpers.reference import ReferenceRuns
from tests.helpers.wait import wait_for
from tests.multihost.test_multihost import ARGS, check_recovered

# longer than tests/multihost/test_multihost.py's 3 s: on busy cores an agent starting its fork template
# was sometimes silent for 3 s, and a host lost at start-up is not what these tests are about
LEASE = 5.0
LAST = int(ARGS[ARGS.index("--steps") + 1]) - 1  # the job's last step


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_killed_coordinator_is_replaced_and_the_job_finishes_bitwise(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, lease=LEASE)
    with job.killed_on_failure():
        job.wait_training(deadline, joined=3)
        step_at_kill = job.committed(0)
        job.coordinator.kill()  # SIGKILL: the coordinator process only; every agent and worker lives on
        killed = time.monotonic()
        job.coordinator.wait(timeout=10)
        wait_for(lambda: job.events("coordinator_failover"), killed + 30, "a new coordinator")
        elected_in = time.monotonic() - killed
        wait_for(lambda: job.committed(0) > step_at_kill + 1, deadline, "a step committed after the failover")
    res = job.finish_agents(deadline)
    assert res.rc == 0, res.output
    check_recovered(res, ref, set())
    fo = job.events("coordinator_failover")
    assert len(fo) == 1, fo
    ev = fo[0]
    assert ev["term"] >= 1 and ev["old"].endswith(":29400"), ev
    assert len(ev["voters"]) >= 2 and ev["missing"] == [] and ev["ranks"] == 4, ev
    assert elected_in < 15, f"a new coordinator took {elected_in:.1f} s"
    assert job.events("coordinator_resumed"), "no committed step after the takeover"
    ends = job.events("job_end")
    assert [e["status"] for e in ends] == ["ok"], ends


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_partition_isolating_the_coordinator_elects_a_successor_on_the_majority_side(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """Host 0 (the coordinator and node 0's agent with ranks 0-1) is cut off: the coordinator
    steps down, host 0's agent fences its workers, the two other hosts elect a successor, ranks
    0-1 move to the spare host with state from ranks 2-3, and the job ends bitwise."""
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, lease=LEASE)
    cluster = job.cluster
    h0 = cluster.hosts[0]
    with job.killed_on_failure():
        job.wait_training(deadline, joined=3)
        h0.partition("both")
        cut = time.monotonic()
        wait_for(lambda: job.events("coordinator_failover"), cut + 40, "a successor on the majority side")
        wait_for(
            lambda: job.coordinator.poll() is not None, cut + 30, "the isolated coordinator to step down"
        )
        # host 0's agent fences its workers: none of ranks 0-1's processes is left there
        wait_for(lambda: len(h0.pids()) <= 2, cut + 30, "host 0's workers to be killed by their agent")
        fenced_in = time.monotonic() - cut
        h0.heal()
    res = job.finish_agents(deadline, lenient=[0])
    assert res.rc == 0, res.output
    check_recovered(res, ref, {0, 1})
    assert job.coordinator.returncode == 75, res.output  # stepped down, did not end the job
    assert job.events("coordinator_step_down"), "the isolated coordinator did not step down"
    ev = job.events("coordinator_failover")[0]
    assert ev["missing"] == [0, 1] and len(ev["voters"]) == 2, ev
    assert fenced_in < 25, f"host 0 was fenced only after {fenced_in:.1f} s"
    moved = {e["rank"] for e in job.events("spare_assigned")}
    assert {0, 1} <= moved, moved
    ends = job.events("job_end")
    assert [e["status"] for e in ends] == ["ok"], ends


# `make soak`: test_a_host_started_after_a_failover_joins_the_successor_and_takes_a_lost_hosts_ranks
# begins with this same loss of host 0 (coordinator, agent and ranks 0-1) and needs the election
# and the recovery of ranks 0-1 on the spare host to go on; the election's time and voters are
# checked by test_killed_coordinator_is_replaced_and_the_job_finishes_bitwise
@pytest.mark.soak
@pytest.mark.netns
@pytest.mark.timeout(240)
def test_coordinator_host_lost_whole_the_others_elect_and_recover_its_ranks(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """Every process on host 0 dies at once (the coordinator, node 0's agent, ranks 0-1): the two
    other agents elect a successor, ranks 0-1 move to the spare host, bitwise."""
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, lease=LEASE)
    cluster = job.cluster
    with job.killed_on_failure():
        job.wait_training(deadline, joined=3)
        assert cluster.hosts[0].kill_all(), "host 0 had no processes to kill"
        killed = time.monotonic()
        wait_for(lambda: job.events("coordinator_failover"), killed + 30, "a new coordinator")
        elected_in = time.monotonic() - killed
    res = job.finish_agents(deadline, lenient=[0])
    assert res.rc == 0, res.output
    check_recovered(res, ref, {0, 1})
    ev = job.events("coordinator_failover")[0]
    # ranks 0-1 died with host 0. On a loaded machine a surviving worker can also miss the
    # successor's gather window (a lease) and is then replaced like them: correct, and the
    # check above holds its shards bitwise either way (seen once in CI; see the session-7 note)
    assert {0, 1} <= set(ev["missing"]) and len(ev["voters"]) == 2, ev
    assert elected_in < 15, f"a new coordinator took {elected_in:.1f} s"
    assert set(ev["missing"]) <= {e["rank"] for e in job.events("spare_assigned")}
    ends = job.events("job_end")
    assert [e["status"] for e in ends] == ["ok"], ends


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_a_host_started_after_a_failover_joins_the_successor_and_takes_a_lost_hosts_ranks(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """Host 0 is lost whole (the coordinator with it) and the spare host takes its ranks. A fourth
    host then starts an agent given, like every agent, the lost coordinator's address (a
    recreated pod, a healed node): it finds the successor through the run directory's record and
    joins as a spare host. The next host lost moves its ranks onto it, and the job ends bitwise."""
    args = [*TINY[2:], "--steps", "160"]  # room for a host to start and join after the failover
    ref = reference(4, script_args=args)
    job, deadline = launch_on_hosts(
        netns_hosts, tmp_path, corpus, args, hosts=4, seconds=260, lease=LEASE, idle=1
    )
    cluster = job.cluster
    h3 = cluster.hosts[3].address
    with job.killed_on_failure():
        job.wait_training(deadline, joined=3)
        record = job.run_dir / "coordinator"
        assert record.read_text().strip() == job.control  # the first coordinator's, as it started
        assert cluster.hosts[0].kill_all(), "host 0 had no processes to kill"
        wait_for(lambda: job.events("coordinator_failover"), deadline, "a new coordinator")
        new = job.events("coordinator_failover")[0]["new"]
        assert record.read_text().strip() == new != job.control
        # host 0's ranks are back on the spare host before the next fault: a second host lost
        # while they still wait for a spare is another scenario (see the session-22 note)
        wait_for(lambda: job.events("recovery"), deadline, "host 0's ranks to be recovered")
        # the steps are not paced: a job this far along could end before the new host joins
        assert job.committed(2) < 100, f"the job is at step {job.committed(2)} of 160 already"
        job.start_agent()  # told --coordinator <the lost one>, as every agent was
        wait_for(
            lambda: [e for e in job.events("host_joined") if e["address"] == h3],
            deadline,
            "the new host to join the successor",
        )
        # lose the host that holds ranks and is not the successor's: its ranks go to the new host
        agent_at = {e["host"]: e["address"] for e in job.events("host_joined")}
        successor = agent_at[job.events("coordinator_failover")[0]["agent"]]
        (victim,) = [i for i in (1, 2) if cluster.hosts[i].address != successor]
        before = len(job.events("recovery"))
        assert cluster.hosts[victim].kill_all(), f"host {victim} had no processes to kill"
        wait_for(
            lambda: len(job.events("recovery")) > before, deadline, "the second host loss to be recovered"
        )
    res = job.finish_agents(deadline, lenient=[0, victim])
    # host 1 holds ranks 2-3 throughout; host 2 (the spare host) took host 0's ranks 0-1
    victim_ranks = {2, 3} if victim == 1 else {0, 1}
    check_recovered(res, ref, {0, 1} | victim_ranks)
    joined = [e for e in job.events("host_joined") if e["address"] == h3]
    assert joined and joined[0]["spare"], joined
    spawned_there = {e["worker"] for e in job.agent_events(h3, "spawn")}
    taken = {e["rank"] for e in job.events("spare_assigned") if e["worker"] in spawned_there}
    assert taken == victim_ranks, (taken, victim, job.events("spare_assigned"))
    ends = job.events("job_end")
    assert [e["status"] for e in ends] == ["ok"], ends
    assert not record.exists(), "the record outlived the job"


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_a_host_out_of_touch_while_the_job_ends_after_a_failover_exits_with_the_jobs_success(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """The spare host's agent is stopped (SIGSTOP) while the coordinator is killed: the other
    two agents elect a successor, which finishes the job. Resumed, the agent finds its
    coordinator gone, fails to win an election, fences and tries to rejoin; the job it would
    rejoin has ended (its secret removed, `job_end` in the event log), so it exits 0 at once,
    not 1 after its --connect-timeout. (Seen in CI without the stop: a spare host that noticed
    the failover late while a short job ended.)"""
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, lease=LEASE)
    run_dir = job.run_dir
    late = job.agents[2]  # the spare host's agent (node order 2)
    try:
        job.wait_training(deadline, joined=3)
        os.kill(late.pid, signal.SIGSTOP)
        job.coordinator.kill()
        wait_for(lambda: job.events("job_end"), deadline, "the successor to finish the job")
        os.kill(late.pid, signal.SIGCONT)
        resumed = time.monotonic()
        _stop_within = 45.0  # a lease to notice, the elections it cannot win, then the rejoin
        late.wait(timeout=_stop_within)
        took = time.monotonic() - resumed
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.kill(late.pid, signal.SIGCONT)
        job.kill()
        raise
    res = job.finish_agents(deadline)
    assert res.rc == 0, res.output  # every agent's exit code counts: the late one's too
    assert late.returncode == 0 and took < _stop_within, (late.returncode, took)
    assert "while this host was out of touch" in (run_dir.parent / "agent-2.out").read_text()
    res.assert_same_weights(ref, nproc=4)
    assert [e["status"] for e in job.events("job_end")] == ["ok"]


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_every_rank_finishing_while_no_coordinator_exists_ends_the_job_ok(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """Every agent is stopped (SIGSTOP) and the coordinator killed a few steps before the end:
    the ranks run their last steps with no coordinator anywhere, and their Done goes nowhere.
    Each waits at its exit until the successor, elected once the agents resume, has heard from
    its hello that it finished; the job then ends ok and bitwise. (Seen in CI: ranks finished
    during a slow election and left; the successor found no process and failed the job as "lost
    before generation 0 formed".)"""
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, lease=LEASE)
    stopped: list[int] = []
    try:
        job.wait_joined(deadline, 3)
        wait_for(lambda: job.committed(0) >= LAST - 4, deadline, f"rank 0 to commit step {LAST - 4}")
        for agent in job.agents:
            os.kill(agent.pid, signal.SIGSTOP)
            stopped.append(agent.pid)
        job.coordinator.kill()
        job.coordinator.wait(timeout=10)
        ranks = range(4)
        wait_for(lambda: min(job.committed(r) for r in ranks) >= LAST, deadline, "every rank's last step")
        time.sleep(0.5)  # past their Done: without a successor to wait for they would be gone
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        wait_for(lambda: job.events("job_end"), deadline, "the successor to end the job")
    except BaseException:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        job.kill()
        raise
    res = job.finish_agents(deadline)
    assert res.rc == 0, res.output
    res.assert_same_weights(ref, nproc=4)
    assert [e["status"] for e in job.events("job_end")] == ["ok"], job.events("job_end")
    assert len(job.events("coordinator_failover")) == 1, job.events("coordinator_failover")
    assert res.output.count("waiting for a coordinator to record it") == 4, res.output


@pytest.mark.soak
@pytest.mark.netns
@pytest.mark.timeout(240)
@pytest.mark.parametrize("before_end", [4, 2, 1, 0])
def test_the_coordinator_killed_in_the_last_steps_never_fails_a_finished_job(
    netns_hosts: Any, tmp_path: Path, corpus: Path, before_end: int, reference: ReferenceRuns
) -> None:
    """The coordinator is SIGKILLed as rank 0 commits one of the last steps (or the last): the
    ranks may still train, sit in the final barrier, run their own code after the loop, wait at
    their exit for their Done to be acknowledged, or have left before the coordinator ended the
    job (then their agents' votes say they finished). Whichever it is, the job ends ok and
    bitwise, with one coordinator_failover at most."""
    ref = reference(4, script_args=ARGS)
    job, deadline = launch_on_hosts(netns_hosts, tmp_path, corpus, ARGS, lease=LEASE)
    with job.killed_on_failure():
        job.wait_joined(deadline, 3)
        at = LAST - before_end
        wait_for(lambda: job.committed(0) >= at, deadline, f"rank 0 to commit step {at}")
        job.coordinator.kill()
        job.coordinator.wait(timeout=10)
    res = job.finish_agents(deadline)
    assert res.rc == 0, res.output
    res.assert_same_weights(ref, nproc=4)
    assert [e["status"] for e in job.events("job_end")] == ["ok"], job.events("job_end")
    assert len(job.events("coordinator_failover")) <= 1, job.events("coordinator_failover")
