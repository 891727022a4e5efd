"""Collectives before the training loop, under the launcher, through real faults, bitwise.

tests/scripts/pre_loop.py runs what scripts and frameworks run between ``checkpointless.init()``
and ``job.steps()``: ``dist.barrier()``, Lightning's ``prepare_data`` barrier (a gloo
``dist.new_group`` with a 10000-day timeout and ``monitored_barrier``), a broadcast of rank 0's
weights, and ``parallelize_module`` with torch's default ``src_data_rank=0`` (a scatter from tp
rank 0 per parameter) on ``job.device_mesh(("dp", "tp"), (1, 2))``. Its ``SequenceParallel``
norm's weight gradient is ``Partial``, settled before the update guard
(recovery/script_mesh.settle_before_update, installed by ``job.track()``).

The job's groups form in ``init()`` (recovery/first_generation.py). A rank lost inside a pre-loop
collective restarts the start-up: the survivor, which had communicated, ends (exit 75) and spares
run the script from the top on both ranks. A rank lost during training has a replacement whose
start-up collectives complete locally (its peers are in the recovery round; it receives its
state). Every rank's shards are compared with the fault-free run's, which equals torch alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import JobResult, run_job
from tests.helpers.paths import SCRIPTS
from tests.helpers.reference import ReferenceRuns

SCRIPT = SCRIPTS / "pre_loop.py"
ARGS = ["--steps", "8"]


@pytest.fixture()
def pre_loop_reference(reference: ReferenceRuns) -> JobResult:
    """The fault-free run (once per session): two tp shards, so two different states."""
    res = reference(2, script=SCRIPT, script_args=ARGS, replicated=False)
    assert sorted(res.digests) == [0, 1] and res.digests[0] != res.digests[1], res.digests
    return res


def _check(res: JobResult, ref: JobResult) -> None:
    assert res.rc == 0, res.output[-6000:]
    wrong = {
        r: (res.digests.get(r, "none")[:12], d[:12])
        for r, d in ref.digests.items()
        if res.digests.get(r) != d
    }
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(150)
def test_a_rank_lost_inside_a_pre_loop_collective_restarts_the_start_up_bitwise(
    tmp_path: Path, corpus: Path, pre_loop_reference: JobResult
) -> None:
    marker = tmp_path / "died"
    args = [*ARGS, "--die-in-broadcast", "1", "--marker", str(marker)]
    res = run_job(tmp_path / "run", corpus, nproc=2, spares=1, script=SCRIPT, script_args=args, timeout=120)
    assert marker.exists(), "rank 1 never died in the broadcast"
    _check(res, pre_loop_reference)
    # absorbed by start-up: no recovery, both ranks' faults named, and both taken by spares
    # that ran the script from the top (rank 0 had communicated, so it started over too)
    assert not res.of("recovery"), res.of("recovery")
    kinds = {f["rank"]: f["kind"] for f in res.startup_faults()}
    assert kinds == {1: "killed", 0: "exit"}, res.startup_faults()
    assert "code 75" in next(f["detail"] for f in res.startup_faults() if f["rank"] == 0)
    assert sorted(e["rank"] for e in res.of("spare_assigned")) == [0, 1]
    assert "rank 0 starts over too" in res.output


@pytest.mark.timeout(150)
def test_a_replacement_runs_the_pre_loop_collectives_locally_and_partial_gradients_settle_bitwise(
    tmp_path: Path, corpus: Path, pre_loop_reference: JobResult
) -> None:
    # the kill: rank 1's replacement runs the barriers, the broadcast and the scatters of its
    # start-up on groups with no communicator yet (they complete locally), then receives its tp
    # shard from its buddy copy; the raise mid-optimizer: the norm's Partial gradient was
    # all-reduced before the guard's barrier, so rank 1's update communicates nothing and stands
    faults = ["kill:rank=1:step=3", "raise:rank=0:step=5:site=optimizer"]
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=2,
        spares=1,
        faults=faults,
        script=SCRIPT,
        script_args=ARGS,
        timeout=120,
    )
    _check(res, pre_loop_reference)
    assert len(res.of("recovery")) == 2 and [e["rank"] for e in res.of("spare_assigned")] == [1], res.output[
        -4000:
    ]


@pytest.mark.timeout(150)
def test_the_pre_loop_script_equals_the_same_training_with_torch_alone(
    tmp_path: Path, corpus: Path, pre_loop_reference: JobResult
) -> None:
    # torch alone (--plain starts it torchrun-style): the same collectives, the same shards
    res = run_job(
        tmp_path / "torch",
        corpus,
        nproc=2,
        spares=0,
        extra=["--plain"],
        script=SCRIPT,
        script_args=[*ARGS, "--torch-only"],
        timeout=120,
    )
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == pre_loop_reference.digests
