"""The state codec round-trips exactly, refuses what it cannot carry, and lands in place."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.arena import Arena
from checkpointless.state.codec import layout, receive_buffers, unpack
from checkpointless.state.snapshot import capture_rng, restore_rng

pytestmark = pytest.mark.timeout(30)


def _round_trip(tree: object, into: object = None) -> tuple[object, int]:
    """What a receiver gets: the sender's messages copied into the receiver's buffers."""
    lay = layout(tree)
    manifest = json.loads(lay.manifest_bytes())
    buffers, in_place = receive_buffers(manifest, into)
    for dst, src in zip(buffers, lay.messages, strict=True):
        dst.copy_(src)
    return unpack(manifest, buffers), in_place


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def test_optimizer_and_model_state_round_trip_exactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sched.step()
    tree = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": 3}
    out, _ = _round_trip(tree)
    assert _equal(tree, out)
    opt2 = torch.optim.AdamW(model.parameters(), lr=5.0)
    opt2.load_state_dict(out["opt"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)


def test_awkward_values_round_trip() -> None:
    tree = {
        "nan": float("nan"),
        "inf": float("-inf"),
        "tiny": 5e-324,
        "tuple": (1, (2.5, "x")),
        "intkeys": {0: "a", 3: [None, True]},
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "npscalar": np.float32(1.5),
        "bf16": torch.randn(4).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.0),
        "dtype": torch.float16,
    }
    assert _equal(tree, _round_trip(tree)[0])


def test_rng_state_round_trips_through_the_codec() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng()
    got, _ = _round_trip(state)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(got)  # type: ignore[arg-type]
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_unsupported_object_is_a_clear_error() -> None:
    with pytest.raises(StateTransferError, match="state_dict"):
        layout({"fn": lambda: 0})


def test_large_tensors_travel_in_place_and_small_ones_packed() -> None:
    tree = {
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(3).to(torch.float16),
        "big": torch.randn(300_000),  # over the solo threshold: its own message, no copy
        "big64": torch.randn(200_000, dtype=torch.float64),
    }
    lay = layout(tree)
    assert len(lay.messages) == 3  # one pack, two solo tensors
    assert lay.messages[1].data_ptr() == tree["big"].data_ptr()  # sent from the tensor itself
    metas = lay.manifest["tensors"]
    assert all(m["offset"] % 64 == 0 for m in metas if not m["solo"])
    assert _equal(tree, _round_trip(tree)[0])


def test_receiver_lands_large_tensors_in_its_own_matching_tensors() -> None:
    torch.manual_seed(0)
    sender = {"model": {"w": torch.randn(512, 1024), "b": torch.randn(7)}, "odd": torch.randn(300_000)}
    own_w = torch.zeros(512, 1024)
    shared = torch.zeros(300_000)
    receiver = {
        "model": {"w": own_w, "b": torch.zeros(7)},
        "odd": torch.zeros(300_000, dtype=torch.float64),  # other dtype: a new tensor instead
    }
    out, in_place = _round_trip(sender, receiver)
    assert _equal(sender, out)
    assert out["model"]["w"].data_ptr() == own_w.data_ptr() and torch.equal(own_w, sender["model"]["w"])
    assert in_place == own_w.numel() * 4
    # tied weights (two paths, one tensor) are filled once; the second path gets its own memory
    tied = {"a": torch.randn(300_000), "b": torch.randn(300_000)}
    out2, in_place2 = _round_trip(tied, {"a": shared, "b": shared})
    assert _equal(tied, out2) and in_place2 == 300_000 * 4


def test_manifest_with_unknown_dtype_is_refused() -> None:
    lay = layout({"w": torch.ones(3)})
    manifest = json.loads(lay.manifest_bytes())
    manifest["tensors"][0]["dtype"] = "os.system"
    with pytest.raises(StateTransferError, match="unknown dtype"):
        unpack(manifest, lay.messages)


def test_unmatched_large_tensors_land_in_the_arena_and_the_tail_is_given_back() -> None:
    tree = {"a": torch.randn(300_000), "b": torch.randn(200_000, dtype=torch.float64), "c": torch.randn(3)}
    arena = Arena(4 << 20)
    lay = layout(tree)
    manifest = json.loads(lay.manifest_bytes())
    buffers, in_place = receive_buffers(manifest, None, arena)
    for dst, src in zip(buffers, lay.messages, strict=True):
        dst.copy_(src)
    out = unpack(manifest, buffers)
    assert _equal(tree, out) and in_place == 0
    base = arena._bytes.data_ptr()
    for name in ("a", "b"):  # the solo tensors, each 64-byte aligned inside the arena
        ptr = out[name].data_ptr()
        assert base <= ptr < base + arena.size and (ptr - base) % 64 == 0
    assert arena.used == 1_200_000 + 1_600_000  # 1,200,000 is a multiple of 64: no padding
    assert arena.release_unused() > 0
    assert torch.equal(out["a"], tree["a"]) and arena.take(torch.float32, (4,)) is None


def test_a_full_arena_falls_back_to_new_memory() -> None:
    arena = Arena(1 << 20)  # smaller than the tensor
    lay = layout({"w": torch.randn(400_000)})
    manifest = json.loads(lay.manifest_bytes())
    buffers, _ = receive_buffers(manifest, None, arena)
    assert arena.used == 0 and buffers[0].numel() == 1_600_000


def _vma_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr`` (Linux)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage")
    or "VmFlags:" not in Path("/proc/self/smaps").read_text(),
    reason="no transparent huge pages, or no VmFlags in smaps (e.g. gVisor)",
)
def test_new_large_tensors_ask_for_huge_pages_and_give_their_memory_back() -> None:
    from checkpointless.state.arena import new_tensor

    small = new_tensor(torch.float32, (100,))
    assert small.numel() == 100  # under 2 MiB: torch's allocator, as usual
    before = _rss()
    big = new_tensor(torch.float64, (8, 4 << 20))  # 256 MiB
    big.fill_(1.5)
    assert big.shape == (8, 4 << 20) and big.dtype == torch.float64 and float(big[7, -1]) == 1.5
    assert "hg" in _vma_flags(big.data_ptr())  # advised for transparent huge pages
    assert _rss() - before > 200 << 20
    del big
    assert _rss() - before < 32 << 20  # the mapping went with the tensor
    arena = Arena(8 << 20)
    assert "hg" in _vma_flags(arena._bytes.data_ptr())
