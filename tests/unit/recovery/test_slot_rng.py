"""Degraded mode's held slots' global generators (issue 39, recovery/slot_rng.py), in one process:
a held slot's pass starts from the lost rank's own record in the job's shared memory and draws
that rank's numbers; the holder's own generators and record keeper come back after the pass,
untouched by it; the slot's next record is written to the slot's files for the spare that takes
it back; without a record the pass is reported inexact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpointless.recovery.rank_rng import RankRngKeeper, rank_rng_dir
from checkpointless.recovery.replicas import ReplicaKeeper
from checkpointless.recovery.slot_rng import HeldGenerators
from checkpointless.state.snapshot import capture_rng

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ReplicaKeeper:
    monkeypatch.setenv("CHECKPOINTLESS_SHM_DIR", str(tmp_path))
    monkeypatch.delenv("CHECKPOINTLESS_SHM_KEY", raising=False)
    r = ReplicaKeeper()
    r.rank_rng.mirror = None
    r.rank_rng.configure(rank_rng_dir("job1"), 0)
    return r


def test_a_held_pass_draws_the_lost_rank_s_numbers_and_the_holder_s_come_back(
    replicas: ReplicaKeeper,
) -> None:
    torch.manual_seed(1002)  # rank 2's generators as it began step 5, kept by its own keeper
    lost = RankRngKeeper()
    lost.configure(rank_rng_dir("job1"), 2)
    lost.keep(5, capture_rng())
    want_lost = torch.rand(3).tolist()
    torch.manual_seed(1000)  # the holder, rank 0
    own_keeper = replicas.rank_rng
    want_own = torch.rand(6).tolist()
    torch.manual_seed(1000)
    held = HeldGenerators()
    reports: list[str] = []
    assert torch.rand(3).tolist() == want_own[:3]  # its own pass
    held.own_pass_ended(replicas, 5)
    held.enter(replicas, "job1", 2, 5, reports.append)
    assert replicas.rank_rng is not own_keeper and replicas.rank_rng.rank == 2
    assert torch.rand(3).tolist() == want_lost  # slot 2's pass: rank 2's numbers
    replicas.rank_rng.at_update(5)  # the last pass's update keeps where slot 2's step 6 starts
    held.leave(replicas)
    assert replicas.rank_rng is own_keeper and not reports
    assert torch.rand(3).tolist() == want_own[3:]  # its next step, as if it drew alone
    # the spare that takes slot 2 back at step 6 finds what the holder kept for it
    spare = RankRngKeeper()
    spare.configure(rank_rng_dir("job1"), 2)
    record = spare.load(6)
    assert record is not None
    torch.manual_seed(1002)
    torch.rand(3)
    after = torch.get_rng_state()
    assert torch.equal(record.rng["torch"], after)
    held.release([0])


def test_without_the_lost_rank_s_record_the_pass_is_reported_inexact(replicas: ReplicaKeeper) -> None:
    held = HeldGenerators()
    reports: list[str] = []
    held.enter(replicas, "job1", 3, 9, reports.append)
    held.leave(replicas)
    assert len(reports) == 1 and "no record of slot 3's own generators for step 9" in reports[0]
    held.release([])
