"""Whether a rank's global generators still stand where a record has them: the compares that
let recovery/rank_rng.py skip a write when nothing drew since its last record (a step entry, an
update, a commit cost a compare, not a capture and a write)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from checkpointless.state.snapshot import RngState

__all__ = ["same_rng", "torch_unchanged", "unchanged"]


def same_rng(a: RngState, b: RngState) -> bool:
    """Whether two captured states are the same (torch's and Python's first: they change most)."""
    if not torch.equal(a["torch"], b["torch"]):
        return False
    pa, pb = a["python"], b["python"]
    if pa[0] != pb[0] or pa[2] != pb[2] or not torch.equal(torch.as_tensor(pa[1]), torch.as_tensor(pb[1])):
        return False
    na, nb = a["numpy"], b["numpy"]
    if list(na[2:]) != list(nb[2:]) or na[0] != nb[0] or not np.array_equal(na[1], nb[1]):
        return False
    ca, cb = a.get("cuda", []), b.get("cuda", [])
    return len(ca) == len(cb) and all(torch.equal(x, y) for x, y in zip(ca, cb, strict=True))


def torch_unchanged(rng: RngState) -> bool:
    """Whether torch's CPU and CUDA generators still stand where ``rng`` has them (a few µs)."""
    if not torch.equal(rng["torch"], torch.get_rng_state()):
        return False
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        now = torch.cuda.get_rng_state_all()
        had = rng.get("cuda", [])
        return len(now) == len(had) and all(torch.equal(a, b) for a, b in zip(now, had, strict=True))
    return "cuda" not in rng


def unchanged(rng: RngState) -> bool:
    """Whether every generator still stands where ``rng`` has them, without a capture: torch's
    first (what a draw most likely used), then NumPy's position and keys, then Python's words."""
    if not torch_unchanged(rng):
        return False
    np_now: Any = np.random.get_state()
    np_kept = rng["numpy"]
    if int(np_now[2]) != int(np_kept[2]) or not np.array_equal(np_now[1], np_kept[1]):
        return False
    version, words, gauss = random.getstate()
    py_kept = rng["python"]
    if version != py_kept[0] or gauss != py_kept[2]:
        return False
    return bool(np.array_equal(np.fromiter(words, dtype=np.int64, count=len(words)), np.asarray(py_kept[1])))
