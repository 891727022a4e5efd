"""Buddy copies between two ranks of one host, through shared-memory files instead of a socket.

Why: when an owner and its keeper share a host (every job on one machine; a host whose ring
wraps onto itself), a copy over loopback TCP costs the owner a send and the keeper a receive
and a digest of every byte, every step: measured ~6 of the ~8 ms of CPU a 5.2 MB copy cost per
rank-step, on cores the training needs. A file in the job's private shared-memory directory
survives the owner's process just as the keeper's memory does (both are lost only with the host),
so the owner packs its copy straight into such a file, which is also its own undo copy, and
sends the keeper only the copy's description: the file, its inode and size, and the XXH3 digest
of its bytes. The keeper reads no byte until the copy is used (a recovery), and checks the digest
then (:func:`read_slot`).

The one rule that makes this safe: **the owner never writes a file its keeper may list.** The
keeper's acknowledgement names the files it lists after taking the copy; the owner writes the
next copy into a file outside that set and outside its own two newest undo copies, and while it
does not know the keeper's set (a new connection, a copy never acknowledged) into a new file.
A copy cut off therefore never damages a listed one. Files are named
``buddy-r<rank>-<token>-n<k>`` with a token drawn once per process: a replacement process never
reuses a dead owner's names (a pid may be reused), and the keeper removes a dead owner's files once
it no longer lists them (:meth:`SlotPool.prune` is the owner's own clean-up). The launcher removes
the job's directory at the end, as it does for snapshots.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.codec import digest

__all__ = ["SlotPool", "SlotRef", "check_slot_name", "read_slot", "writer_of"]

_NAME = re.compile(r"^buddy-r(\d{1,9})-([0-9a-f]{16})-n(\d{1,12})$")


@dataclass(frozen=True)
class SlotRef:
    """A copy that lies in a file: what the keeper lists instead of the bytes."""

    name: str
    inode: int
    nbytes: int
    digest: str  # XXH3-128 of the copy's bytes, checked when the copy is used


def check_slot_name(name: object, owner: int) -> str:
    """``name`` when it names a copy file of rank ``owner`` (a plain file name, never a path)."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None or int(m.group(1)) != owner:
        raise StateTransferError(f"rank {owner}'s copy names no file of its own: {name!r}")
    assert isinstance(name, str)
    return name


def writer_of(name: str) -> str:
    """Which process wrote a copy file: a token drawn once per process (a pid can be reused)."""
    m = _NAME.match(name)
    return m.group(2) if m else ""


class SlotPool:
    """The owner's copy files, each mapped once for the process's life and written in place."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory = directory
        self.rank = rank
        self._token = secrets.token_hex(8)  # this process's files, whatever its pid
        self._next = 0
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor, int]] = {}  # name -> map, bytes, inode

    def take(self, nbytes: int, avoid: set[str] | None) -> tuple[str, torch.Tensor, int]:
        """A file of ``nbytes`` to write the next copy into: (name, its bytes, inode). One outside
        ``avoid`` is reused when its size fits; ``avoid=None`` (the keeper's list is unknown)
        avoids every existing file."""
        for name, (_, data, inode) in self._maps.items():
            if avoid is not None and name not in avoid and int(data.numel()) == nbytes:
                return name, data, inode
        name = f"buddy-r{self.rank}-{self._token}-n{self._next}"
        self._next += 1
        path = self.directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            # reserved now: a full /dev/shm is an OSError here, not a SIGBUS in the copy thread
            os.posix_fallocate(fd, 0, max(nbytes, 1))
            m = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
            inode = os.fstat(fd).st_ino
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        data = torch.frombuffer(m, dtype=torch.uint8)[:nbytes]
        self._maps[name] = (m, data, inode)
        return name, data, inode

    def prune(self, keep: set[str]) -> None:
        """Remove this process's files outside ``keep`` (the keeper's list and the undo copies),
        keeping one spare of each size in use so that the next copy needs no new file."""
        spare: set[int] = set()
        for name in sorted(self._maps):
            if name in keep:
                continue
            size = int(self._maps[name][1].numel())
            if size not in spare:
                spare.add(size)
                continue
            self._maps.pop(name)  # the tensor view keeps the mapping until it is dropped
            (self.directory / name).unlink(missing_ok=True)

    def nbytes(self) -> int:
        return sum(int(data.numel()) for _, data, _ in list(self._maps.values()))


def read_slot(directory: Path, owner: int, ref: SlotRef, verify: bool = True) -> torch.Tensor:
    """The bytes of a copy that lies in a file, as a private tensor, checked against the file's
    inode, its size and (``verify``) the digest it was announced with. Raises StateTransferError
    when the file is gone, was replaced, or holds other bytes."""
    path = directory / check_slot_name(ref.name, owner)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise StateTransferError(f"rank {owner}'s copy file {ref.name} is gone: {e}") from e
    try:
        st = os.fstat(fd)
        if st.st_ino != ref.inode or st.st_size < ref.nbytes:
            raise StateTransferError(f"rank {owner}'s copy file {ref.name} was replaced")
        out = torch.empty(ref.nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy()).cast("B")
        got = 0
        while got < ref.nbytes:
            n = os.preadv(fd, [view[got:]], got)
            if n <= 0:
                raise StateTransferError(f"rank {owner}'s copy file {ref.name} is shorter than announced")
            got += n
    finally:
        os.close(fd)
    if verify and digest(out) != ref.digest:
        raise StateTransferError(f"rank {owner}'s copy in {ref.name} does not match its digest")
    return out
