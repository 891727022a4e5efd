"""Tensor parallel across hosts: each TP group on one host, and a whole host's TP group lost (issue 37).

2 hosts x 2 ranks + 1 hot-spare host, each host a network namespace with a shared-memory
directory of its own. tests/scripts/tp_mlp.py runs dp 2 x tp 2 (``init_device_mesh`` with "tp"
last, ``parallelize_module`` Colwise then Rowwise): rank r is (dp r // 2, tp r % 2), so each TP
group is one replica, and host-major placement must put it on one host: its TP all-reduces, in
forward and in backward, never leave the host, and the two replicas are on different hosts.
Every commit says where its step ran (the rank's TP group and its host's network namespace).

Mid-run host 1 is lost whole, with replica 1's TP group (ranks 2 and 3) on it. The spare host
takes both ranks together, so the new TP group is again on one host, and each rank receives its
tp shard from the same tp coordinate in the surviving replica (2 from 0, 3 from 1). Every rank's
final parameters and AdamW state must be bit for bit the fault-free run's.

The loss lands in step 4: rank 0 is slowed by 4 s as that step begins (``slow``, no fault by
itself), so the eight short steps are still running when the test kills the host. The
namespaces, their processes and the shared-memory directories are removed by the fixtures
(tests/helpers/harness/fixtures.py, ``host_shm_dirs``), also after a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import host_shm_dirs, launch_on_hosts
from tests.helpers.jobs import SCRIPTS, JobResult
from tests.helpers.reference import ReferenceRuns

TP_SCRIPT = SCRIPTS / "tp_mlp.py"
ARGS = ["--steps", "8"]  # test_tp_e2e's: the same fault-free reference run serves both
LOSS_STEP = 4


def where(res: JobResult) -> dict[tuple[int, int], tuple[int, tuple[int, ...]]]:
    """(rank, step) -> (host, TP group) of the step's last commit (a replayed step's replay)."""
    return {(e["rank"], e["step"]): (e["host"], tuple(e["tp_group"])) for e in res.commits()}


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_tp_groups_stay_on_one_host_and_a_lost_hosts_tp_group_recovers_bitwise(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = reference(4, script=TP_SCRIPT, script_args=ARGS, replicated=False)
    d = ref.digests
    assert sorted(d) == [0, 1, 2, 3] and d[0] == d[2] and d[1] == d[3] and d[0] != d[1], d
    with host_shm_dirs(3) as shm:
        job, deadline = launch_on_hosts(
            netns_hosts,
            tmp_path,
            corpus,
            ARGS,
            script=TP_SCRIPT,
            shm_dirs=shm,
            seconds=150,
            inject=[f"slow:rank=0:step={LOSS_STEP}:seconds=4"],
        )
        with job.killed_on_failure():
            # both of host 1's ranks: one killed between its update and its commit record keeps
            # its state (every rank resumes after that step) but loses the record the batch
            # check below reads (the two-worker suite: rank 3's step 3 missing)
            job.wait_training(deadline, rank=2, step=LOSS_STEP - 1)
            job.wait_training(deadline, rank=3, step=LOSS_STEP - 1)
            assert job.committed(0) < LOSS_STEP, "the job went past the step of the loss"
            assert job.cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
        res = job.finish(deadline)
    assert res.rc == 0, res.output[-6000:]
    assert [e["ranks"] for e in job.events("host_lost")] == [[2, 3]], res.output[-4000:]
    wrong = {r: (res.digests.get(r, "none")[:12], v[:12]) for r, v in d.items() if res.digests.get(r) != v}
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    assert res.batches() == ref.batches(), "some rank trained on other samples than the fault-free run"

    # placement: every step of every rank ran with its TP group on one host, the replicas apart
    ran = where(res)
    assert sorted(ran) == [(r, s) for r in range(4) for s in range(8)], sorted(ran)
    for (rank, step), (host, group) in ran.items():
        assert group == (rank - rank % 2, rank - rank % 2 + 1), (rank, step, group)
        assert all(ran[(peer, step)][0] == host for peer in group), f"TP group {group} split at step {step}"
        assert ran[((rank + 2) % 4, step)][0] != host, f"both replicas on one host at step {step}"
    # the spare host took the lost host's TP group whole: a host none of the ranks ran on before
    before = {ran[(r, 0)][0] for r in range(4)}
    assert ran[(2, 7)][0] == ran[(3, 7)][0] and ran[(2, 7)][0] not in before, ran
    assert {ran[(r, 7)][0] for r in (0, 1)} == {ran[(0, 0)][0]}, "replica 0 moved"

    # one recovery, from the host's loss; each lost rank got its tp shard from its tp peer
    plans = [{r: s for r, s in e.get("sources", [])} for e in res.of("plan") if e["generation"] > 0]
    assert plans == [{2: 0, 3: 1}], plans
    assert len(res.of("recovery")) == 1, res.output[-4000:]
    assert not res.left_behind(), "processes of the job were left behind"
