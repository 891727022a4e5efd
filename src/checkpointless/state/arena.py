"""Memory a hot spare pages in while it waits, so that received state lands in it at wire speed.

A new allocation costs a page fault per 4 KiB on first touch; receiving into one ran at about
half the speed of receiving into memory already paged in. A spare has the time to pay that
before any fault: the launcher tells it how large a replica's state is, and it maps and
populates that much. A transfer then carves the tensors it has no own tensor for (a spare has
its model, but no optimizer state yet) out of the arena, and gives the unused tail back.
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["Arena"]

_ALIGN = 64


class Arena:
    """One populated anonymous mapping, handed out front to back as tensors."""

    def __init__(self, nbytes: int) -> None:
        self.size = max(int(nbytes), mmap.PAGESIZE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, self.size, flags=flags)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the mapping alive
        if not getattr(mmap, "MAP_POPULATE", 0):
            self._bytes.fill_(0)  # no MAP_POPULATE on this platform: touch every page instead
        self.used = 0

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A tensor of ``dtype`` and ``shape`` in the arena, or None when it no longer fits."""
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + nbytes > self.size:
            return None
        self.used = start + nbytes
        return self._bytes[start : start + nbytes].view(dtype).reshape(shape)

    def reset(self) -> None:
        """Hand out from the start again: the tensors of a failed transfer are dropped, not used."""
        self.used = 0

    def release_unused(self) -> int:
        """Give the pages past what was handed out back to the system; return how many bytes."""
        start = -(-self.used // mmap.PAGESIZE) * mmap.PAGESIZE
        if start >= self.size or not hasattr(self._map, "madvise"):
            return 0
        self._map.madvise(mmap.MADV_DONTNEED, start, self.size - start)
        freed = self.size - start
        self.used = self.size  # the tail now reads as zeros; hand nothing more out of it
        return freed
