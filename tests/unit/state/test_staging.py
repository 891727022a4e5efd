"""The staged layout a step's copies are made from, remembered between steps
(state/staging.py): every step's layout must say exactly what a fresh layout of that step's state
says, and its messages must hold that step's bytes, whatever changed in between."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch

from checkpointless.state.codec import Layout, layout
from checkpointless.state.device_copy import copy_out, host_buffer
from checkpointless.state.snapshot import collect_state
from checkpointless.state.staging import guarded_pointers, staged_layout
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.a(x)))
        self.seen += out.detach().sum(0)  # a buffer the forward pass changes: not guarded
        return out


def _setup() -> tuple[_Tiny, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, {"model": model, "optimizer": opt}


def _train(model: _Tiny, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _bytes(lay: Layout) -> list[bytes]:
    return [bytes(m.numpy().tobytes()) for m in lay.messages]


def _same_as_fresh(state: Any, guarded: set[int]) -> Layout:
    staged = staged_layout(state, guarded)
    fresh = layout(state, solo_min=0)
    assert staged.manifest == fresh.manifest
    assert _bytes(staged) == _bytes(fresh)
    return staged


def test_each_step_is_laid_out_as_a_fresh_layout_would_be() -> None:
    model, opt, objects = _setup()
    _train(model, opt)  # the optimizer's state exists from here on
    for step in range(4):
        state = collect_state(objects, step, None)
        _same_as_fresh(state, guarded_pointers([opt]))
        _train(model, opt)


def test_guarded_tensors_are_views_and_the_rest_copies() -> None:
    model, opt, objects = _setup()
    _train(model, opt)
    guarded = guarded_pointers([opt])
    for step in range(2):  # the second time from memory
        state = collect_state(objects, step, None)
        lay = staged_layout(state, guarded)
        by_path = {m["path"]: lay.messages[int(m["msg"])] for m in lay.manifest["tensors"]}
        weight = next(v for k, v in by_path.items() if "a.weight" in k)
        seen = next(v for k, v in by_path.items() if "seen" in k)
        assert weight.data_ptr() == model.a.weight.data_ptr()  # read by the copy, later
        assert seen.data_ptr() != model.seen.data_ptr()  # the forward pass may change it: copied
        before = bytes(seen.numpy().tobytes())
        model(torch.randn(5, 4))
        assert bytes(seen.numpy().tobytes()) == before


def test_a_tensor_given_other_memory_shape_or_strides_is_laid_out_anew() -> None:
    model, opt, objects = _setup()
    _train(model, opt)
    guarded = guarded_pointers([opt])
    _same_as_fresh(collect_state(objects, 0, None), guarded)
    # the optimizer's state tensors are the same objects every step (unlike a plain module's
    # state dict): the ones that stay the same objects while what they are changes
    square = opt.state[model.a.weight]["exp_avg"]
    square.t_()  # same memory, same shape, other strides
    _same_as_fresh(collect_state(objects, 1, None), guarded)
    square.t_()
    opt.state[model.b.weight]["exp_avg_sq"].set_(torch.rand(7))  # other memory and shape
    _same_as_fresh(collect_state(objects, 2, None), guarded)
    with torch.no_grad():
        model.b.weight.data = torch.randn(2, 5)
    _same_as_fresh(collect_state(objects, 3, None), guarded)


def test_a_tensor_replaced_at_the_same_place_and_a_changed_tree() -> None:
    model, opt, objects = _setup()
    _train(model, opt)
    guarded = guarded_pointers([opt])
    base = collect_state(objects, 0, None)
    _same_as_fresh({"s": base, "extra": torch.ones(3)}, guarded)
    _same_as_fresh({"s": base, "extra": torch.ones(4, dtype=torch.float64)}, guarded)  # new object
    _same_as_fresh({"s": base}, guarded)  # fewer tensors
    _same_as_fresh({"first": torch.zeros(1), "s": base}, guarded)  # every tensor moved by one
    # the same objects under other names: paths come from this state, not the last
    renamed = {"t": base}
    lay = _same_as_fresh(renamed, guarded)
    assert all(m["path"].startswith("/'t'") for m in lay.manifest["tensors"])


def test_a_host_layout_lands_through_copy_out_with_the_staged_bytes() -> None:
    """On the host a staged layout needs no event (``ready`` is None), and ``copy_out`` lands each
    message in its destination as it was staged, whatever the forward pass changes after; a
    destination list that does not match is refused (the CUDA path: benchmarks/gpu_check.py)."""
    model, opt, objects = _setup()
    _train(model, opt)
    lay = staged_layout(collect_state(objects, 0, None), guarded_pointers([opt]))
    assert lay.ready is None
    staged = _bytes(lay)
    model(torch.randn(5, 4))  # changes the unguarded buffer in place
    sizes = [int(m.numel()) for m in lay.messages]
    out = host_buffer(sum(sizes), lay.ready)
    copy_out(lay.messages, list(out.split(sizes)), lay.ready)
    assert [bytes(p.numpy().tobytes()) for p in out.split(sizes)] == staged
    with pytest.raises(ValueError, match="2 messages for 1 destinations"):
        copy_out(lay.messages[:2], [out], None)


def test_the_gpu_checks_staging_check_holds_on_the_host() -> None:
    """benchmarks/gpu_check.py's ``staging_cuda`` runs only where a GPU is lent; its logic (stage,
    change the state on the training side at once, land the undo copy and a snapshot, compare
    bitwise with the state as staged) is run here on the host so that it cannot rot unseen."""
    path = ROOT / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = mod.check_staging_cuda("cpu", 64)
    assert out["ok"] and out["undo_copy_bitwise"] and out["snapshot_bitwise"], out
