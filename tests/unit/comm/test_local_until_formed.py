"""``ResilientProcessGroup.local_until_formed``: a replacement's collectives before job.steps().

A replacement runs the script's start-up while its peers wait in the recovery round, so a
collective there has no partner; with the switch on, one on a group that has never formed
completes at once and leaves its tensors as they are, an all-gather's filled with its own input
(the state received at ``job.steps()`` replaces what it would have brought). Without it, the same call fails as "not configured yet".
One process, no peers: the group is never formed.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.errors import CommAborted

pytestmark = pytest.mark.timeout(30)


@pytest.fixture()
def pg() -> Iterator[ResilientProcessGroup]:
    group = ResilientProcessGroup(1, 2, (0, 1), datetime.timedelta(seconds=5))
    try:
        yield group
    finally:
        ResilientProcessGroup.local_until_formed = False


def test_an_unformed_group_fails_a_collective_and_counts_it(pg: ResilientProcessGroup) -> None:
    t = torch.ones(3)
    with pytest.raises(CommAborted, match="not configured yet"):
        pg.allreduce([t], dist.AllreduceOptions()).wait()
    assert pg.issued == 1


def test_with_the_switch_a_collective_on_an_unformed_group_completes_locally(
    pg: ResilientProcessGroup,
) -> None:
    ResilientProcessGroup.local_until_formed = True
    t = torch.arange(3.0)
    work = pg.broadcast([t], dist.BroadcastOptions())
    assert work.is_completed() and work.wait()
    pg.barrier().wait()
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    assert t.tolist() == [0.0, 1.0, 2.0]  # untouched
    # an all-gather brings its own input in every rank's place: what DDP's construction
    # compares (every rank's parameter shapes) then agrees
    out = [torch.zeros(3), torch.zeros(3)]
    pg.allgather([out], [t]).wait()
    assert all(o.tolist() == [0.0, 1.0, 2.0] for o in out)
    flat = torch.zeros(6)
    pg.all_gather_single(flat, t).wait()
    assert flat.tolist() == [0.0, 1.0, 2.0] * 2
    assert pg.issued == 0  # nothing was communicated: it does not count


def test_the_switch_applies_only_to_groups_that_never_formed(pg: ResilientProcessGroup) -> None:
    ResilientProcessGroup.local_until_formed = True
    store = dist.HashStore()
    solo = ResilientProcessGroup(0, 1, (0,), datetime.timedelta(seconds=5))
    solo.configure(0, store, deadline=time.monotonic() + 10)
    try:
        t = torch.ones(2)
        solo.allreduce([t], dist.AllreduceOptions()).wait()  # a real one-rank all-reduce
        assert solo.issued == 1 and solo.generation == 0
    finally:
        solo.close()
