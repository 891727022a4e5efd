"""Buddy copies: every rank's shard state, kept in the memory of a rank on another host.

Why: on a sharded mesh without a replica (plain FSDP, ``R = 1``), a rank's shard exists nowhere
else, so losing the process loses the shard. Each rank therefore streams its state (the same tree
a peer would send: its local shards, optimizer state, RNG, step) to its *keeper*, the rank one host
over (state/buddy_ring.py), once per step. The recovery plan (recovery/decisions.py) then names
the keeper as the source of the lost rank's shard.

When, and why the copy is consistent: the copy of the state as step k begins (k steps committed)
starts on a background thread at the beginning of step k, straight from the live tensors, while
step k's forward and backward run; the optimizer's update of step k waits for the keeper's
acknowledgement first (:meth:`BuddyCopies.wait_sent`), the rule the shared-memory snapshots follow.
Tensors that a forward pass may change (buffers, RNG states, scheduler state) are copied at once.

Transport: the owner's own key server (state/stream.py), on a channel of its own per generation
and owner, verified with XXH3-128 like any state transfer, never through the training group (so a
copy never queues behind a collective, nor a collective behind it).

What a keeper holds: the two newest *verified* copies per owner. A new copy lands in the older
one's tensors, which are unlisted the moment the owner's manifest arrives (not before: between
copies both stay listed), so a transfer cut off by a fault never leaves a half-written copy
listed, and the newest verified one always survives. Memory: at most
two times the owner's state per keeper (reported as ``extra_bytes``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from checkpointless.errors import CommAborted, StateTransferError
from checkpointless.events import get_logger
from checkpointless.state.codec import Layout, unpack
from checkpointless.state.shm_snapshot import staged_layout
from checkpointless.state.stream import StreamRoute, stream_receive, stream_send

__all__ = ["BuddyCopies", "copy_channel", "keep_channel"]

log = get_logger()

_KEEP = 2  # verified copies kept per owner
_RETRY_S = 0.05  # a keeper whose owner is unreachable (dead, not started) tries again this often
# Of the interval between the last two copies, slept before asking for the next. A keeper that
# wakes early asks the owner's key server every 5 ms until the offer (a sealed request and reply
# each: CPU the ranks' training lacks); one that wakes late makes the owner's update wait for the
# copy. Tried 0.75: on short, uneven steps (tests' tiny model) updates waited for late keepers.
_NAP_FRACTION = 0.5
_NAP_MAX = 1.0
_ABORT_POLL_S = 0.02  # an update waiting for its copy sees a job abort this soon
_ABORT_GRACE_S = 0.5  # ... and leaves this much later if the copy has not ended by itself


def keep_channel(generation: int, owner: int) -> str:
    """The stream channel an owner's per-step copy travels on."""
    return f"buddy/gen{generation}/r{owner}"


def copy_channel(generation: int, receiver: int) -> str:
    """The channel a keeper sends a kept copy back to its owner on during a recovery."""
    return f"state/gen{generation}/copy-r{receiver}"


def _nbytes(tree: Any) -> int:
    from checkpointless.state.codec import tensor_paths

    return sum(int(t.numel()) * t.element_size() for t in tensor_paths(tree).values())


class BuddyCopies:
    """One rank's side of the ring: it sends its own copies and keeps its owners'."""

    def __init__(self, rank: int, keeper: int | None, owners: list[int], timeout: float) -> None:
        self.rank = rank
        self.keeper = keeper  # who keeps this rank's copy (None: nobody, a world of one)
        self.owners = owners  # whose copies this rank keeps
        self.timeout = timeout
        self._route: StreamRoute | None = None
        self._generation = -1
        self._lock = threading.Lock()
        self._held: dict[int, dict[int, Any]] = {o: {} for o in owners}  # owner -> step -> tree
        self._sender: threading.Thread | None = None
        self._sent = threading.Event()
        self._sent.set()
        self._cancel = threading.Event()
        self._stop = threading.Event()
        self._keepers: list[threading.Thread] = []
        self.last_send: dict[str, float] = {}  # the newest acknowledged copy's step, bytes, seconds
        self.failed = 0  # copies not acknowledged (keeper gone, cancelled)
        self.skipped = 0  # copies not started because the previous one was still in flight
        self.last_wait = 0.0  # seconds the last update waited for its copy (the critical-path cost)

    # -- the owner's side ------------------------------------------------------------------------
    def start(self, step: int, state: Any, guarded: set[int], staged: Layout | None = None) -> bool:
        """Begin sending ``state`` (taken as step ``step`` begins) to the keeper. ``staged`` is
        :func:`~checkpointless.state.shm_snapshot.staged_layout` of that state when the caller
        has it already (shared with the step's snapshot); otherwise it is made here."""
        route = self._route
        if self.keeper is None or route is None:
            return False
        if self._sender is not None and self._sender.is_alive():
            self.skipped += 1  # never queue: the optimizer waits for one copy at most
            return False
        if staged is None:
            staged = staged_layout(state, guarded)
        lay = Layout(staged.manifest, list(staged.messages))  # our own list: _send clears it
        self._sent.clear()
        self._cancel.clear()
        route = dataclasses.replace(route, channel=keep_channel(self._generation, self.rank))
        self._sender = threading.Thread(
            target=self._send, args=(step, lay, route, self.keeper), name=f"cl-buddy-{step}", daemon=True
        )
        self._sender.start()
        return True

    def _send(self, step: int, lay: Layout, route: StreamRoute, keeper: int) -> None:
        t0 = time.monotonic()
        nbytes = sum(int(m.numel()) for m in lay.messages)
        try:
            stream_send(
                route,
                lay,
                lay.manifest_bytes(),
                [keeper],
                t0 + self.timeout,
                lambda: "cancelled" if self._cancel.is_set() else None,
            )
            self.last_send = {"step": step, "bytes": float(nbytes), "send_s": time.monotonic() - t0}
        except Exception as e:  # a lost copy must not fail training: the plan knows what is kept
            self.failed += 1
            log.info("buddy copy of step %d to rank %d not acknowledged: %s", step, keeper, e)
        finally:
            lay.messages.clear()  # drop our views of the live tensors before anyone waits on us
            self._sent.set()

    def wait_sent(self, timeout: float, aborted: Callable[[], str | None] | None = None) -> float:
        """Block until the copy in flight is acknowledged (or failed); return the seconds waited.
        Past ``timeout`` the copy is cancelled: the update must not change tensors being sent.

        ``aborted`` (the job's generation: a reason once it was aborted) is asked every
        ``_ABORT_POLL_S``: a copy whose keeper died, or left to recover, is never acknowledged,
        and the update waiting for it must leave the step at once like any collective, or the
        launcher would take this rank for hung. Raises :class:`CommAborted` then, the copy cancelled
        (unless it ends by itself within ``_ABORT_GRACE_S``)."""
        if self._sent.is_set():
            self.last_wait = 0.0
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + timeout
        while not self._sent.wait(timeout=max(0.0, min(_ABORT_POLL_S, deadline - time.monotonic()))):
            reason = aborted() if aborted is not None else None
            # A keeper that died resets the stream, so the copy ends by itself (failed) at about
            # the moment the abort arrives: then the update goes on as it always did (the plan
            # knows which copies are kept). Only a copy still pending after a grace period (its
            # keeper alive but gone to recover, never to connect) is abandoned.
            if reason is not None and not self._sent.wait(timeout=_ABORT_GRACE_S):
                self._cancel.set()
                self._sent.wait(timeout=2.0)  # the stream notices the cancel within its poll
                self.last_wait = time.monotonic() - t0
                raise CommAborted(f"buddy copy to rank {self.keeper} abandoned: {reason}")
            if reason is not None:
                break
            if time.monotonic() >= deadline:
                self._cancel.set()
                log.warning("buddy copy took over %.0f s; cancelled it", timeout)
                self._sent.wait(timeout=2.0)
                break
        self.last_wait = time.monotonic() - t0
        return self.last_wait

    # -- the keeper's side -----------------------------------------------------------------------
    def resume(self, generation: int, route: StreamRoute | None) -> None:
        """After a generation has formed: send over its streams, and keep every owner's copies."""
        self._generation = generation
        self._route = route
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

    def _keep(self, owner: int, route: StreamRoute) -> None:
        def landing() -> Any:
            # called once the owner's manifest has arrived: only then is the oldest copy given
            # up (unlisted, then overwritten), so both copies stay listed while nothing travels
            with self._lock:
                held = self._held[owner]
                return held.pop(min(held)) if len(held) >= _KEEP else None

        last = None  # when the previous copy arrived
        while not self._stop.is_set():
            try:
                manifest, buffers, _ = stream_receive(
                    route,
                    owner,
                    self.rank,
                    time.monotonic() + self.timeout,
                    lambda: "stopped" if self._stop.is_set() else None,
                    landing,
                    None,
                )
                tree = unpack(manifest, buffers)
                step = int(tree["step"])
            except (StateTransferError, KeyError, TypeError, ValueError) as e:
                if not self._stop.is_set():
                    log.debug("buddy copy from rank %d not received: %s", owner, e)
                    self._stop.wait(_RETRY_S)
                continue
            with self._lock:
                held = self._held[owner]
                held[step] = tree
                for old in sorted(held)[:-_KEEP]:
                    del held[old]
            # The next copy starts when the owner's next step does, about one step from now.
            # Asking for it at once would poll the owner's key server for the whole step; so
            # sleep through most of the last interval between copies first (_NAP_FRACTION).
            now = time.monotonic()
            if last is not None:
                self._stop.wait(min(_NAP_MAX, _NAP_FRACTION * (now - last)))
            last = now

    def stop(self, timeout: float) -> None:
        """Before a recovery: cancel the copy in flight and stop keeping (bounded). Copies being
        received are dropped; every listed one is verified."""
        self._cancel.set()
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in [self._sender, *self._keepers]:
            if t is not None:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._keepers = []
        self._sent.set()

    def held(self) -> list[tuple[int, int]]:
        """(owner, step) of every verified copy kept here."""
        with self._lock:
            return sorted((o, s) for o, steps in self._held.items() for s in steps)

    def copy(self, owner: int, step: int) -> Any:
        with self._lock:
            tree = self._held.get(owner, {}).get(step)
        if tree is None:
            raise StateTransferError(f"no buddy copy of rank {owner} at step {step} is kept here")
        return tree

    @property
    def extra_bytes(self) -> int:
        """The memory the kept copies take now (at most two per owner)."""
        with self._lock:
            trees = [t for steps in self._held.values() for t in steps.values()]
        return sum(_nbytes(t) for t in trees)
