"""The keeper's side of buddy copies (state/buddy.py): receiving other ranks' copies, listing
them, and handing one out in a recovery.

Separate from the owner's side (state/buddy_owner.py) because a rank keeps its owners' copies on
threads of their own, one per owner, apart from its own copies: the two sides share only the
rank's lock, CPU counters and shared-memory directory, and the record of a copy (:class:`_Copy`,
which the owner's undo copies are too).

What a keeper holds: the two newest *verified* copies per owner, as bytes (the tree is rebuilt
only when a copy is used). A new copy lands in the older one's buffer, which is unlisted the
moment the owner's copy begins to arrive (not before: between copies both stay listed), so a
transfer cut off by a fault never leaves a half-written copy listed, and the newest verified one
always survives.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.events import get_logger
from checkpointless.rendezvous.peers import parse_address
from checkpointless.state.buddy_shm import SlotRef, read_slot, writer_of
from checkpointless.state.buddy_stream import Copy, CopyReceiver
from checkpointless.state.codec import unpack
from checkpointless.state.stream import StreamRoute

__all__ = ["KeeperSide"]


def _host(address: str) -> str:
    return parse_address(address)[0]


log = get_logger()

_KEEP = 2  # verified copies kept per owner
_RETRY_S = 0.05  # a keeper whose owner is unreachable (dead, not started) tries again this often


@dataclasses.dataclass
class _Copy:
    """A copy of one rank's state as a step began: its manifest and its bytes, packed into one
    buffer (a tensor's bytes at its ``offset``). The tree is rebuilt only when the copy is used."""

    manifest: dict[str, Any]
    buffers: list[torch.Tensor]  # one packed message (none on a keeper whose owner shares its host)
    layout: str = ""  # digest of the layout part (state/buddy_stream.py): equal ones share buffers
    slot: SlotRef | None = None  # where the bytes lie when they are in a file (state/buddy_shm.py)
    received: Copy | None = None  # a keeper's copy in a file, as it arrived (its tree unparsed)

    def tree(self) -> Any:
        return unpack(self.manifest, self.buffers)


class KeeperSide:
    """A rank's keeping of its owners' copies; a part of :class:`~checkpointless.state.buddy.BuddyCopies`,
    which sets the attributes shared with the owner's side and starts and stops :meth:`_keep`."""

    # set by BuddyCopies, shared with the owner's side
    rank: int
    timeout: float
    shm_dir: Path | None
    _lock: threading.Lock
    cpu_s: dict[str, float]

    def _init_keeper(self, owners: list[int]) -> None:
        self.owners = owners  # whose copies this rank keeps
        self._held: dict[int, dict[int, _Copy]] = {o: {} for o in owners}  # owner -> step -> copy
        self._stop = threading.Event()

    def _keep(self, owner: int, route: StreamRoute) -> None:
        def landing(layout: str) -> list[torch.Tensor] | None:
            # called once the owner's copy has begun: only then is the oldest copy given up
            # (unlisted, then overwritten), so both copies stay listed while nothing travels
            with self._lock:
                held = self._held[owner]
                old = held.pop(min(held)) if len(held) >= _KEEP else None
            return old.buffers if old is not None and old.layout == layout else None

        same_host = _host(route.peers[owner]) == _host(route.peers[self.rank])

        def keep(got: Copy) -> list[str]:
            # listed before it is acknowledged: the acknowledgement names the files listed now
            tree = got.manifest["tree"]  # (a copy in a file: checked when used, Copy.parse_tree)
            if tree is not None and tree.get("step") != got.step:
                raise StateTransferError(f"rank {owner}'s copy of step {got.step} holds another step")
            if got.slot is not None and (self.shm_dir is None or not same_host):
                raise StateTransferError(f"rank {owner} sent a copy in a file, and no file is shared here")
            with self._lock:
                held = self._held[owner]
                held[got.step] = _Copy(got.manifest, got.buffers, got.layout, got.slot, got)
                dropped = [held.pop(old) for old in sorted(held)[:-_KEEP]]
                files = [c.slot.name for c in held.values() if c.slot is not None]
            if got.slot is not None and self.shm_dir is not None:
                # a replaced owner's files: its process is gone, and nobody else removes them
                # before the job ends (the owner that wrote this copy prunes its own)
                writer = writer_of(got.slot.name)
                for c in dropped:
                    if c.slot is not None and writer_of(c.slot.name) != writer:
                        (self.shm_dir / c.slot.name).unlink(missing_ok=True)
            return files

        stream = CopyReceiver(route, owner, self.rank)
        stopped: Callable[[], str | None] = lambda: "stopped" if self._stop.is_set() else None  # noqa: E731
        try:
            while not self._stop.is_set():
                try:
                    stream.receive(self.timeout, stopped, landing, keep, cpu=self.cpu_s)
                except (StateTransferError, AttributeError, KeyError, TypeError, ValueError) as e:
                    if not self._stop.is_set():
                        log.debug("buddy copy from rank %d not received: %s", owner, e)
                        self._stop.wait(_RETRY_S)
                    continue
        finally:
            stream.close()

    def held(self) -> list[tuple[int, int]]:
        """(owner, step) of every verified copy kept here. A copy that lies in a file is listed
        while that file is still the one announced (its bytes are checked when it is used)."""
        with self._lock:
            kept = [(o, s, c.slot) for o, steps in self._held.items() for s, c in steps.items()]
        return sorted((o, s) for o, s, slot in kept if slot is None or self._file_intact(slot))

    def _file_intact(self, slot: SlotRef) -> bool:
        assert self.shm_dir is not None
        try:
            st = os.stat(self.shm_dir / slot.name, follow_symlinks=False)
        except OSError:
            return False
        return st.st_ino == slot.inode and st.st_size >= slot.nbytes

    def copy(self, owner: int, step: int) -> Any:
        with self._lock:
            kept = self._held.get(owner, {}).get(step)
        if kept is None:
            raise StateTransferError(f"no buddy copy of rank {owner} at step {step} is kept here")
        if kept.slot is not None:
            assert self.shm_dir is not None and kept.received is not None
            try:
                manifest = kept.received.parse_tree()
                return unpack(manifest, [read_slot(self.shm_dir, owner, kept.slot)])
            except StateTransferError:
                # A file that fails its check now always will: unlisted, so that the next round
                # plans with what is left (another step, a snapshot) instead of this copy again.
                with self._lock:
                    if self._held.get(owner, {}).get(step) is kept:
                        del self._held[owner][step]
                raise
        return kept.tree()

    @property
    def kept_copies(self) -> int:
        with self._lock:
            return sum(len(steps) for steps in self._held.values())

    @property
    def extra_bytes(self) -> int:
        """The memory the kept copies take now (at most two per owner)."""
        with self._lock:
            kept = [k for steps in self._held.values() for k in steps.values()]
        return sum(int(b.numel()) for k in kept for b in k.buffers)
