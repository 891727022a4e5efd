"""A mesh the script made itself, learned from its DTensors (recovery/script_mesh.py): which
dimensions a tensor-parallel model's state is split along. One process on torch's fake process
group of 4 ranks, so that a real dp x tp mesh and ``parallelize_module`` run without peers
(``src_data_rank=None``: each rank cuts its own shard, no collective)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from checkpointless.errors import ConfigError
from checkpointless.recovery.script_mesh import script_mesh_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _mlp(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(model, mesh["tp"], plan, src_data_rank=None)


def test_a_tp_model_is_split_over_tp_and_replicated_over_dp(mesh: Any) -> None:
    found = script_mesh_of(_mlp(mesh).parameters())
    assert found is not None and found.device_mesh is mesh
    assert found.ranks == (0, 1, 2, 3)
    assert found.layout.names == ("dp", "tp") and found.layout.replicate == {"dp"}
    assert found.layout.plan_shape() == (2, 2)
    assert found.layout.holders(1) == [3]


def test_replicated_dtensors_alone_split_nothing(mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    bias = distribute_tensor(torch.zeros(3), mesh["tp"], [Replicate()], src_data_rank=None)
    found = script_mesh_of([bias, torch.zeros(2)])
    assert found is not None and found.layout.replicate == {"dp", "tp"}


def test_plain_tensors_have_no_mesh() -> None:
    assert script_mesh_of([torch.zeros(2), nn.Parameter(torch.ones(1))]) is None


def test_a_flattened_mesh_counts_every_dimension_as_split(mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    flat = mesh["dp", "tp"]._flatten("dp_tp")
    t = distribute_tensor(torch.zeros(8), flat, [Shard(0)], src_data_rank=None)
    found = script_mesh_of([t])
    assert found is not None and found.layout.replicate == frozenset()
    assert found.layout.plan_shape() == (1, 4)  # each rank's state is its own: never a wrong source


def test_dtensors_of_two_unrelated_meshes_are_refused(mesh: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    other = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    a = distribute_tensor(torch.zeros(4), mesh["tp"], [Shard(0)], src_data_rank=None)
    b = distribute_tensor(torch.zeros(4), other, [Shard(0)], src_data_rank=None)
    with pytest.raises(ConfigError, match="different device meshes"):
        script_mesh_of([a, b])


def test_the_adopted_run_names_the_tp_coordinate_and_leaves_the_script_groups_alone(mesh: Any) -> None:
    import datetime

    from checkpointless.comm.process_group import ResilientProcessGroup
    from checkpointless.errors import StateTransferError
    from checkpointless.recovery.sharded import ShardedRun

    world = ResilientProcessGroup(1, 4, [0, 1, 2, 3], datetime.timedelta(seconds=5))
    run = ShardedRun.adopt(mesh, world, (2, 2), rank=3)
    assert run.device_mesh is mesh and run.shape == (2, 2) and run.coordinate == (1, 1)
    # the script groups form, abort and release the mesh's groups: the run drives none of them
    assert run.mesh.groups == [] and run.abort("test") == 0 and run.aborted() is None
    run.configure(0, dist.HashStore(), deadline=0.0, cancelled=None)  # past its deadline: no-op
    assert world.generation == -1
    ident = run.identity()
    assert ident.state_dict() == {"replicate": 2, "shards": 2, "shard": 1}
    with pytest.raises(StateTransferError, match="shard 0"):
        ident.load_state_dict({"replicate": 2, "shards": 2, "shard": 0})  # another tp coordinate


def test_partial_gradients_are_settled_before_every_other_step_hook(mesh: Any) -> None:
    # a SequenceParallel norm's gradient is Partial: the job all-reduces it before the update
    # guard's barrier, so that the update itself communicates nothing (script_mesh.py)
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from checkpointless.recovery.script_mesh import settle_before_update, settle_gradients

    w = nn.Parameter(distribute_tensor(torch.ones(4), mesh["tp"], [Replicate()], src_data_rank=None))
    v = nn.Parameter(distribute_tensor(torch.ones(4), mesh["tp"], [Shard(0)], src_data_rank=None))
    w.grad = DTensor.from_local(torch.ones(4), mesh["tp"], [Partial()], run_check=False)
    v.grad = DTensor.from_local(torch.ones(2), mesh["tp"], [Shard(0)], run_check=False)
    kept = v.grad
    opt = torch.optim.SGD([w, v], lr=0.1)
    order: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: order.append(f"guard sees {w.grad.placements}"))
    settle_before_update(opt)
    opt.step()
    assert order == ["guard sees (Replicate(),)"]
    assert v.grad is kept  # already laid out like its parameter: untouched
    w.grad = DTensor.from_local(torch.ones(4), mesh["tp"], [Partial()], run_check=False)
    settle_gradients(opt)
    assert w.grad.placements == (Replicate(),)
