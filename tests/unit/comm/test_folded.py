"""A folded replicate group (degraded HSDP, comm/folded.py): FSDP2's own all-reduce of the
replica passes' sum is finished locally (SUM as it is, AVG divided by the group's size); every
other collective on it, the script's own all-reduce included, is refused, never answered with
this process's part alone. One process, no peers: a folded group forms no communicator."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

# a stand-in for FSDP2's reduce: the same function name in a file of the same name
_FAKE_FSDP = compile(
    "def foreach_reduce(pg, t, op):\n"
    "    opts = AllreduceOptions()\n"
    "    opts.reduceOp = op\n"
    "    return pg.allreduce([t], opts)\n",
    "/fake/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
    "exec",
)


def _fsdp_reduce() -> Any:
    scope: dict[str, Any] = {"AllreduceOptions": dist.AllreduceOptions}
    exec(_FAKE_FSDP, scope)
    return scope["foreach_reduce"]


def _folded() -> ResilientProcessGroup:
    pg = ResilientProcessGroup(0, 2, (0, 2), datetime.timedelta(seconds=5))
    pg.folded = True
    return pg


def test_fsdps_all_reduce_is_finished_locally() -> None:
    pg, reduce = _folded(), _fsdp_reduce()
    t = torch.tensor([3.0, -5.0, 1e-3])
    reduce(pg, t, dist.ReduceOp.AVG).wait()
    assert torch.equal(t, torch.tensor([1.5, -2.5, 5e-4]))  # the sum over both replicas, / 2
    reduce(pg, t, dist.ReduceOp.SUM).wait()
    assert torch.equal(t, torch.tensor([1.5, -2.5, 5e-4]))  # already the sum
    with pytest.raises(ConfigError, match="only FSDP2's SUM or AVG"):
        reduce(pg, t, dist.ReduceOp.MAX)


def test_every_other_collective_is_refused_naming_the_group() -> None:
    pg = _folded()
    t = torch.ones(2)
    with pytest.raises(ConfigError, match=r"folded replicate group r0\.2"):
        pg.allreduce([t], dist.AllreduceOptions())  # the script's own: not FSDP2's sum
    assert torch.equal(t, torch.ones(2))
    with pytest.raises(ConfigError, match="folded replicate group"):
        pg.barrier()
    with pytest.raises(ConfigError, match="folded replicate group"):
        pg.broadcast([t], 0)


def test_an_unfolded_group_is_left_to_its_generation() -> None:
    pg = _folded()
    pg.folded = False
    with pytest.raises(Exception, match="not configured yet"):
        _fsdp_reduce()(pg, torch.ones(2), dist.ReduceOp.AVG).wait()
