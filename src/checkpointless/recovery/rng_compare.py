"""Whether a rank's global generators still stand where a record has them: the compares that
let recovery/rank_rng.py skip a write when nothing drew since its last record (a step entry, an
update, a commit cost a compare, not a capture and a write)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from checkpointless.state.rng_read import numpy_state, python_state
from checkpointless.state.snapshot import RngState

__all__ = ["same_rng", "torch_unchanged", "unchanged"]


def _raw(x: Any, dtype: type[np.generic]) -> bytes:
    """A generator's state words as bytes: compared as bytes, which costs well under a µs,
    where ``torch.equal`` or ``np.array_equal`` of a few KB costs several (this runs a few
    times every step)."""
    arr = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return (arr if arr.dtype == dtype else arr.astype(dtype)).tobytes()


def _same_torch(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(_raw(x, np.uint8) == _raw(y, np.uint8) for x, y in zip(a, b, strict=True))


def same_rng(a: RngState, b: RngState) -> bool:
    """Whether two captured states are the same (torch's and Python's first: they change most)."""
    if not _same_torch([a["torch"], *a.get("cuda", [])], [b["torch"], *b.get("cuda", [])]):
        return False
    pa, pb = a["python"], b["python"]
    if pa[0] != pb[0] or pa[2] != pb[2] or _raw(pa[1], np.int64) != _raw(pb[1], np.int64):
        return False
    na, nb = a["numpy"], b["numpy"]
    return (
        list(na[2:]) == list(nb[2:]) and na[0] == nb[0] and _raw(na[1], np.uint32) == _raw(nb[1], np.uint32)
    )


def torch_unchanged(rng: RngState) -> bool:
    """Whether torch's CPU and CUDA generators still stand where ``rng`` has them (a few µs)."""
    now = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        now += torch.cuda.get_rng_state_all()
    return _same_torch(now, [rng["torch"], *rng.get("cuda", [])])


def unchanged(rng: RngState) -> bool:
    """Whether every generator still stands where ``rng`` has them, without a capture: torch's
    first (what a draw most likely used), then NumPy's (its cached Gaussian too), then Python's.
    Read from the generators' memory (state/rng_read.py), not through the public getters, which
    cost more than all the rest of a step's keeping."""
    if not torch_unchanged(rng):
        return False
    kind, keys, pos, has_gauss, gauss = numpy_state()
    np_kept = rng["numpy"]
    if [kind, pos, has_gauss, gauss] != [np_kept[0], *np_kept[2:]] or keys.tobytes() != _raw(
        np_kept[1], np.uint32
    ):
        return False
    version, words, py_gauss = python_state()
    py_kept = rng["python"]
    return version == py_kept[0] and py_gauss == py_kept[2] and words.tobytes() == _raw(py_kept[1], np.int64)
