"""The sharded module's state as every step begins (recovery/sharded.py:LocalModuleState): its
remembered state dict must always be what ``state_dict()`` would give now. One process, a real
FSDP2 model on a gloo group of one, trained with AdamW between reads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from checkpointless.recovery.sharded import LocalModuleState

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def fsdp_model() -> Iterator[nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def _fresh(model: nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in model.state_dict().items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].data_ptr() == want[k].data_ptr(), k


def _train(model: nn.Module, opt: Any) -> None:
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_the_remembered_state_follows_training_and_replaced_tensors(fsdp_model: nn.Module) -> None:
    state = LocalModuleState(fsdp_model)
    opt = torch.optim.AdamW(fsdp_model.parameters(), lr=0.1)
    first = state.state_dict()
    _same(first, _fresh(fsdp_model))
    for _ in range(3):
        _train(fsdp_model, opt)
        _same(state.state_dict(), _fresh(fsdp_model))  # the views see the updates
    assert state._memo is not None, "a plain FSDP2 module's state dict is remembered"
    # a buffer replaced by another tensor, and a parameter's shard given new memory
    fsdp_model[1].register_buffer("seen", torch.arange(3.0))
    _same(state.state_dict(), _fresh(fsdp_model))
    fsdp_model[1].seen = torch.arange(5.0)
    _same(state.state_dict(), _fresh(fsdp_model))
    # the same parameter object over other memory (torch.utils.swap_tensors, as module
    # conversions may do): only the addresses tell
    w = fsdp_model[0].weight
    with torch.no_grad():
        other = nn.Parameter(DTensor.from_local(w.to_local() + 1, w.device_mesh, w.placements))
    before = id(w)
    torch.utils.swap_tensors(w, other)
    assert id(fsdp_model[0].weight) == before
    _same(state.state_dict(), _fresh(fsdp_model))


def test_a_module_with_a_state_dict_hook_is_read_every_time(fsdp_model: nn.Module) -> None:
    calls = []

    def hook(module: nn.Module, sd: dict[str, Any], prefix: str, local: Any) -> None:
        calls.append(prefix)
        sd[prefix + "extra"] = torch.tensor(float(len(calls)))

    fsdp_model[2]._register_state_dict_hook(hook)
    state = LocalModuleState(fsdp_model)
    a, b = state.state_dict(), state.state_dict()
    assert state._memo is None
    assert float(a["2.extra"]) == 1.0 and float(b["2.extra"]) == 2.0
