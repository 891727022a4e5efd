"""The state codec round-trips exactly, refuses what it cannot carry, and detects corruption."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.codec import decode, encode
from checkpointless.state.snapshot import capture_rng, restore_rng

pytestmark = pytest.mark.timeout(30)


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
    enc = encode(tree)
    out = decode(enc.manifest, enc.payload.clone())
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
    enc = encode(tree)
    assert _equal(tree, decode(enc.manifest, enc.payload))


def test_rng_state_round_trips_through_the_codec() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng()
    enc = encode(state)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(decode(enc.manifest, enc.payload))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_corrupted_payload_is_refused() -> None:
    enc = encode({"w": torch.ones(1000)})
    bad = enc.payload.clone()
    bad[17] ^= 1
    with pytest.raises(StateTransferError, match="checksum mismatch"):
        decode(enc.manifest, bad)
    with pytest.raises(StateTransferError, match="bytes"):
        decode(enc.manifest, enc.payload[:-1].clone())


def test_unsupported_object_is_a_clear_error() -> None:
    with pytest.raises(StateTransferError, match="state_dict"):
        encode({"fn": lambda: 0})


def test_large_tensors_after_odd_sized_ones_round_trip_in_place() -> None:
    tree = {
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(3).to(torch.float16),
        "big": torch.randn(300_000),  # over the in-place threshold: decoded as a view
        "big64": torch.randn(200_000, dtype=torch.float64),
    }
    enc = encode(tree)
    assert all(m["offset"] % 64 == 0 for m in enc.manifest["tensors"])
    out = decode(enc.manifest, enc.payload)
    assert _equal(tree, out)
