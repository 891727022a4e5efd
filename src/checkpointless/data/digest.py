"""One digest for a batch, shared by the loader, the shared-memory cache and the tests.

The cache stores this digest as the checksum of each batch file, so a cache hit is verified and
its digest known without hashing twice, and tests compare runs with the very same function.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = ["array_digest", "batch_digest"]


def array_digest(x: npt.NDArray[Any], y: npt.NDArray[Any]) -> str:
    """sha256 over the dtypes and shapes, then the C-order bytes, of inputs and targets."""
    h = hashlib.sha256(f"{x.dtype.str}{list(x.shape)}{y.dtype.str}{list(y.shape)};".encode())
    for a in (x, y):
        # memoryview of a contiguous array: hashlib reads the buffer in place, no copy.
        h.update(np.ascontiguousarray(a).data.cast("B"))
    return h.hexdigest()


def batch_digest(x: torch.Tensor | npt.NDArray[Any], y: torch.Tensor | npt.NDArray[Any]) -> str:
    """Hex sha256 of a batch (torch tensors on any device, or numpy arrays)."""

    def as_numpy(t: torch.Tensor | npt.NDArray[Any]) -> npt.NDArray[Any]:
        if isinstance(t, np.ndarray):
            return t
        return t.detach().cpu().contiguous().numpy()  # type: ignore[no-any-return]

    return array_digest(as_numpy(x), as_numpy(y))
