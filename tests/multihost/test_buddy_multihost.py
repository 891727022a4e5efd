"""Composition: a sharded job without replicas loses a whole host, and its shards come back from
the buddy copies kept on the other host.

2 hosts x 2 ranks + 1 hot-spare host (network namespaces), FSDP 1x4 (R = 1: no shard has a
replica). Buddies are one host over: ranks 2 and 3 (host 1) keep their copies on ranks 0 and 1
(host 0), and the reverse. Every process of host 1 is killed at once; its ranks move to the spare
host and take their shards from host 0's buddies. Every rank's final shards must be bit for bit
those of the fault-free run.

The truly mutual pair: on 2 hosts x 2 ranks the ring puts rank 0's copy on rank 2 and rank 2's on
rank 0. Both killed in one step lose both copies; the job must take the documented fallback
(each replacement loads its rank's own snapshot) or end with the documented error, never train
on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import host_shm_dirs, launch_on_hosts
from tests.helpers.jobs import TINY, JobResult
from tests.helpers.reference import ReferenceRuns

ARGS = [*TINY[2:], "--steps", "40", "--fsdp", "1,4"]
CONTROL_PORT = 29410


def _fsdp_reference(reference: ReferenceRuns) -> JobResult:
    ref = reference(4, script_args=ARGS, replicated=False)
    assert len(set(ref.digests.values())) == 4, ref.digests  # four different shards
    return ref


@pytest.mark.netns
@pytest.mark.soak  # `make soak`: the same fallback on one host is in tests/e2e/test_buddy_e2e.py
@pytest.mark.timeout(300)
def test_fsdp_mutual_pair_killed_together_falls_back_or_stops_with_the_documented_error(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    from checkpointless.state.buddy_ring import buddy_of

    assert buddy_of(0, 4, 2) == 2 and buddy_of(2, 4, 2) == 0  # the pair keeps each other's copies
    ref = _fsdp_reference(reference)
    # Rank 2 dies in its update of step 5 (after every collective of the step), rank 0 as it
    # begins step 6: nothing between the two deaths can stop rank 0, so both are lost in one
    # generation, each with the only copies of the other's shard (tests/e2e/test_buddy_e2e.py).
    kills = ("kill:rank=2:step=5:site=optimizer", "kill:rank=0:step=6")
    with host_shm_dirs(3) as shm:
        job, deadline = launch_on_hosts(
            netns_hosts,
            tmp_path,
            corpus,
            ARGS,
            control_port=CONTROL_PORT,
            inject=kills,
            shm_dirs=shm,
            # the per-rank snapshots the fallback reads, at every step (every 50 by default)
            launcher_flags=["--snapshot-every", "1"],
        )
        res = job.finish(deadline)
        assert not [p for d in shm for p in d.iterdir()], "shared memory was left behind"
    plans = [e for e in job.events("plan") if e["generation"] > 0]
    if res.rc != 0:
        # the documented error: no replica, no copy, no snapshot the replacements can reach
        assert "no replica, no buddy copy and no snapshot" in res.output, res.output[-6000:]
        assert not res.digests, f"no rank may finish with a result: {res.digests}"
    else:
        # The fallback: each replacement read its rank's own snapshot, which it can only when
        # it was placed on the rank's own host (each host has its own shared memory here)
        wrong = {r: d[:12] for r, d in ref.digests.items() if res.digests.get(r) != d}
        assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
        got, want = res.batches(), ref.batches()
        assert not {k for k in got if got[k] != want.get(k)}, "some rank trained on other samples"
    both = [p for p in plans if {0, 2} <= set(p.get("receivers", []))]
    for p in both:  # lost together: neither can have been served the other's (lost) copy
        served = {(r, s) for r, s in p.get("sources", []) if r in p.get("from_copy", [])}
        assert not served & {(0, 2), (2, 0)}, p
        assert {0, 2} <= set(p.get("own_snapshot", [])), p
    if res.rc == 0:
        assert both, f"the two kills were not recovered together: {plans}"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_fsdp_host_loss_is_recovered_from_buddies_on_the_other_host(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = _fsdp_reference(reference)
    with host_shm_dirs(3) as shm:
        job, deadline = launch_on_hosts(
            netns_hosts, tmp_path, corpus, ARGS, control_port=CONTROL_PORT, shm_dirs=shm
        )
        job.wait_training(deadline)
        assert job.cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
        res = job.finish(deadline)
        # the surviving hosts' agents removed the job's shared memory (host 1's died with it)
        assert not [p for i in (0, 2) for p in shm[i].iterdir()], "shared memory was left behind"
    assert res.rc == 0, res.output[-6000:]
    wrong = {r: d[:12] for r, d in ref.digests.items() if res.digests.get(r) != d}
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    got, want = res.batches(), ref.batches()
    assert not {k for k in got if got[k] != want.get(k)}, "some rank trained on other samples"
    assert [e["ranks"] for e in job.events("host_lost")] == [[2, 3]]
    # host 1's shards came from the copies host 0 keeps: rank 2's on rank 0, rank 3's on rank 1
    plans = [e for e in job.events("plan") if e["generation"] > 0]
    served = {r: s for p in plans for r, s in p.get("sources", []) if r in p.get("from_copy", [])}
    assert served.get(2) == 0 and served.get(3) == 1, plans
    assert not res.left_behind(), "processes of the job were left behind"
