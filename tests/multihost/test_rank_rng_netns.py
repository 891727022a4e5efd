"""A whole host lost, and its ranks' own generators with it (issue 38).

2 hosts x 2 ranks + 1 hot-spare host, each host a network namespace with a shared-memory
directory of its own (as real hosts have): a script that draws per rank from the global
generators (batch offsets from ``torch.randint`` seeded ``1337 + rank``, ``nn.Dropout``'s masks,
Python's ``random``, and half of each batch from a ``StatefulDataLoader`` with ``shuffle=True``
whose sampler's generator is seeded from that per-rank seed) loses host 1 mid-run. Its ranks'
generator records, loader positions included, died with its shared memory; each rank also keeps
its record with the rank one host over (recovery/rank_rng_peer.py), so the replacements on the
spare host resume the lost ranks' own streams and their own loader positions, and every rank
ends bitwise equal to the fault-free run. Without those copies the job still ended with rc 0, but
with a "no record of rank 2's own generators" warning and other weights than the fault-free run;
without the positions in the record (before recovery/rank_data.py), ranks 2 and 3 shuffled as
the rank that sent them their state did, silently.

Later in the same job rank 1 raises half-way through its update of step 20: it receives its
replica's state (the step rolls forward) and must load its own positions, from its own record in
memory, over the sender's.

The namespaces, their processes and the shared-memory directories are removed by the fixtures
(tests/helpers/harness/fixtures.py, ``host_shm_dirs``), also after a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import host_shm_dirs, launch_on_hosts
from tests.helpers.jobs import SCRIPTS
from tests.helpers.reference import ReferenceRuns

SCRIPT = SCRIPTS / "dropout_global_rng.py"
ARGS = ["--steps", "30", "--sleep", "0.05", "--loader"]
RAISE = "raise:rank=1:step=20:site=optimizer"


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_host_loss_resumes_the_lost_ranks_own_generators(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = reference(4, script=SCRIPT, script_args=ARGS)
    batches = ref.batches()
    assert all(batches[(0, s)] != batches[(2, s)] for s in range(30)), "the ranks' streams must differ"
    with host_shm_dirs(3) as shm:
        job, deadline = launch_on_hosts(
            netns_hosts,
            tmp_path,
            corpus,
            ARGS,
            script=SCRIPT,
            shm_dirs=shm,
            seconds=160,  # it also recovers from an exception at step 20; loaded CI cores
            inject=[RAISE],
        )
        with job.killed_on_failure():
            job.wait_training(deadline, rank=2, step=8)
            assert job.cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
        res = job.finish(deadline)
    assert res.rc == 0, res.output[-6000:]
    assert [e["ranks"] for e in job.events("host_lost")] == [[2, 3]]
    res.assert_same_weights(ref, nproc=4)
    assert "no record of rank" not in res.output, res.output[-6000:]
    assert not res.of("inexact"), res.of("inexact")
    assert not res.of("job_end")[-1]["inexact"]
    for rank in (2, 3):  # from the keeper one host over: host 1's shared memory went with it
        assert f"resuming rank {rank}'s own generators of step" in res.output, res.output[-6000:]
    # rank 1, whose update was cut short, received its replica's state (and kept its own positions)
    assert any(1 in p["receivers"] for p in res.of("plan")), res.of("plan")
    got, want = res.batches(), ref.batches()
    wrong = sorted(k for k in got if got[k] != want.get(k))
    assert not wrong, f"ranks drew other batches than in the fault-free run at {wrong}"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.netns
@pytest.mark.timeout(260)
def test_a_lost_record_is_reported_never_silent(
    netns_hosts: Any, tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    """With ``--rendezvous tcp`` there are no key servers to carry the copies: the lost host's
    records are gone. The job still ends (rc 0), but each replacement's resume is an ``inexact``
    event, and ``job_end`` accounts for both."""
    reference(4, script=SCRIPT, script_args=ARGS)
    with host_shm_dirs(3) as shm:
        job, deadline = launch_on_hosts(
            netns_hosts,
            tmp_path,
            corpus,
            ARGS,
            script=SCRIPT,
            shm_dirs=shm,
            seconds=180,  # `make test` runs another test beside this one on 2 cores
            launcher_flags=["--rendezvous", "tcp"],
        )
        with job.killed_on_failure():
            job.wait_training(deadline, rank=2, step=8)
            assert job.cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
        res = job.finish(deadline)
    assert res.rc == 0, res.output[-6000:]
    inexact = res.of("inexact")
    assert {e["rank"] for e in inexact} == {2, 3} and {e["what"] for e in inexact} == {"rng"}, inexact
    assert all("no record of rank" in e["detail"] for e in inexact), inexact
    end = res.of("job_end")[-1]
    assert sorted(x["rank"] for x in end["inexact"]) == [2, 3], end
    assert "may differ from the run without the faults" in res.output, res.output[-3000:]
