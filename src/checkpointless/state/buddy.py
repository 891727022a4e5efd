"""Buddy copies: every rank's shard state, kept in the memory of a rank on another host.

Why: on a sharded mesh without a replica (plain FSDP, ``R = 1``), a rank's shard exists nowhere
else, so losing the process loses the shard. Each rank therefore streams its state (the same tree
a peer would send: its local shards, optimizer state, RNG, step) to its *keeper*, the rank one host
over (state/buddy_ring.py), once per step. The recovery plan (coordinator/rules/decisions.py) then names
the keeper as the source of the lost rank's shard.

Every rank is both: an *owner* that sends its own copies and keeps its undo copies
(state/buddy_owner.py: when a copy is made, and why it is consistent), and a *keeper* of its
owners' copies (state/buddy_keeper.py: what a keeper holds). This module joins the two sides in
:class:`BuddyCopies` and opens and closes each generation's streams for both.

Transport: one stream per generation from owner to keeper (state/buddy_stream.py), opened through
the owner's own key server, kept open, and verified with XXH3-128 like any state transfer; never
the training group (so a copy never queues behind a collective, nor a collective behind it). A
keeper on the owner's own host gets no bytes on it: the owner's undo copies are then files in the
job's shared-memory directory, which outlive the owner's process as the keeper's memory would, and
the stream carries only which file holds the copy and its digest (state/buddy_shm.py), checked
when the copy is used.

Memory: two times the owner's state per keeper (``extra_bytes``) and two times the rank's own
(``undo_bytes``); with a same-host keeper, none in the keeper and three times the rank's own state
in its files (two undo copies and the one the next copy is written into).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from checkpointless.events import get_logger
from checkpointless.state.buddy_keeper import KeeperSide, _host
from checkpointless.state.buddy_owner import OwnerSide
from checkpointless.state.buddy_shm import SlotPool
from checkpointless.state.buddy_stream import CopySender
from checkpointless.state.stream import StreamRoute

__all__ = ["BuddyCopies", "copy_channel", "keep_channel"]

log = get_logger()


def keep_channel(generation: int, owner: int) -> str:
    """The stream channel an owner's per-step copy travels on."""
    return f"buddy/gen{generation}/r{owner}"


def copy_channel(generation: int, receiver: int) -> str:
    """The channel a keeper sends a kept copy back to its owner on during a recovery."""
    return f"state/gen{generation}/copy-r{receiver}"


class BuddyCopies(OwnerSide, KeeperSide):
    """One rank's side of the ring: it sends its own copies and keeps its owners'."""

    def __init__(
        self,
        rank: int,
        keeper: int | None,
        owners: list[int],
        timeout: float,
        shm_dir: Path | None = None,
        every: int = 1,
    ) -> None:
        if every < 1:
            raise ValueError(f"BuddyCopies: every must be 1 or more steps (got {every})")
        self.rank = rank
        self.timeout = timeout
        self._lock = threading.Lock()
        # CPU seconds spent so far: laying out (the training thread's), sending, keeping
        self.cpu_s = {"stage": 0.0, "send": 0.0, "keep": 0.0}
        # the shared-memory directory both ends of a same-host copy share (state/buddy_shm.py)
        self.shm_dir = shm_dir
        self._init_owner(keeper, every)
        self._init_keeper(owners)
        self._keepers: list[threading.Thread] = []  # this generation's keeping threads, one per owner

    def resume(self, generation: int, route: StreamRoute | None) -> None:
        """After a generation has formed: send over its streams, and keep every owner's copies."""
        self._generation = generation
        if route is not None and self.keeper is not None:
            channel = keep_channel(generation, self.rank)
            self._stream = CopySender(dataclasses.replace(route, channel=channel), self.keeper)
            same_host = _host(route.peers[self.keeper]) == _host(route.peers[self.rank])
            if same_host and self.shm_dir is not None and self._pool is None:
                self._pool = SlotPool(self.shm_dir, self.rank)
            elif not same_host:
                self._pool = None  # (a keeper moved off this host: copies go over the network)
            self._keeper_files = None  # a new keeper process may list anything of ours
        if route is None:
            if self.keeper is not None and generation == 0:
                # copies travel through the key servers of the root-less rendezvous only
                log.warning("buddy copies are off: they need --rendezvous rootless (the default)")
            return
        self._stop.clear()
        self._keepers = [
            threading.Thread(
                target=self._keep,
                args=(owner, dataclasses.replace(route, channel=keep_channel(generation, owner))),
                name=f"cl-buddy-keep-{owner}",
                daemon=True,
            )
            for owner in self.owners
        ]
        for t in self._keepers:
            t.start()

    def stop(self, timeout: float) -> None:
        """Before a recovery: cancel the copy in flight and stop keeping (bounded). Copies being
        received are dropped; every listed one is verified."""
        self._cancel.set()
        self._stop.set()
        deadline = time.monotonic() + timeout
        # the copy thread lives on (the copy in flight ends at the cancel): wait for that copy
        self._sent.wait(timeout=max(0.0, deadline - time.monotonic()))
        for t in self._keepers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._keepers = []
        if self._stream is not None:  # the next generation has a stream of its own
            self._stream.close()
            self._stream = None
        self._sent.set()
