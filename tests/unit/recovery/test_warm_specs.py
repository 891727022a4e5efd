"""A hot spare's warm-up of the job's DTensor optimizer step (recovery/warm_specs.py): rank 0's
description travels as JSON, a process without any process group (a spare) warms up on it, and a
replacement's first real step then decides no sharding anew. One process on torch's fake process
group of 4 ranks (a real dp x tp mesh without peers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from checkpointless.recovery import warm_specs

pytestmark = pytest.mark.timeout(120)


def _job() -> tuple[Any, torch.optim.Optimizer]:
    """The fake group's rank 1: a dp x tp mesh, a tensor-parallel MLP, AdamW over its DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # widths no other test uses: torch's decisions are cached for the process, with no way to clear
    model = nn.Sequential(nn.Linear(5, 14), nn.ReLU(), nn.Linear(14, 7))
    parallelize_module(
        model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=None
    )
    return mesh, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


class _Decisions:
    """Counts the sharding decisions torch works out anew (its caches missed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        dispatcher = DTensor._op_dispatcher
        slow = dispatcher._propagate_op_sharding_dispatch_slow_path

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return slow(*args, **kwargs)

        monkeypatch.setattr(dispatcher, "_propagate_op_sharding_dispatch_slow_path", counted)


@pytest.fixture()
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    monkeypatch.setattr(warm_specs, "_STAND_INS", [])
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_spare_warms_up_so_that_a_replacements_first_step_decides_nothing_anew(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, opt = _job()
    recipe = json.loads(json.dumps(warm_specs.describe([opt])))  # as it travels, in a Prepare
    assert [o["name"] for o in recipe["optimizers"]] == ["AdamW"]
    assert recipe["optimizers"][0]["groups"][0]["hyper"]["weight_decay"] == 0.1
    dist.destroy_process_group()

    decided = _Decisions(monkeypatch)
    warm_specs.prewarm(recipe)  # a spare: no process group at all
    assert not dist.is_initialized()
    assert decided.count > 0  # cold before: the warm-up worked its decisions out

    mesh, opt = _job()  # the replacement builds the same model on the job's mesh
    warm_specs.adopt(opt)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    decided.count = 0
    opt.step()
    opt.step()
    assert decided.count == 0  # every decision of both steps came from the warm-up
    # a stand-in the cache hands out now works as the job's mesh: its groups and its root
    for m in warm_specs._STAND_INS:
        if m == mesh:
            assert m._get_root_mesh() is mesh and m.get_group(1) is mesh.get_group(1)


def test_optimizers_that_cannot_be_described_give_no_recipe(fresh: None) -> None:
    _, opt = _job()
    plain = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)  # no DTensor
    assert warm_specs.describe([plain]) is None
    tensor_lr = torch.optim.AdamW(opt.param_groups[0]["params"], lr=torch.tensor(0.01))
    assert warm_specs.describe([tensor_lr]) is None
    assert warm_specs.describe([]) is None


def test_adopt_without_a_warm_up_changes_nothing(fresh: None) -> None:
    _, opt = _job()
    warm_specs.adopt(opt)
    assert warm_specs._STAND_INS == []
