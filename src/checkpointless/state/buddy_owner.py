"""The owner's side of buddy copies (state/buddy.py): sending this rank's own state to its keeper
once per step, and keeping its own undo copies.

Separate from the keeper's side (state/buddy_keeper.py) because it runs on the training thread
and the rank's one copy thread, on the rank's own state, and decides what the update waits for.

When, and why the copy is consistent: the copy of the state as step k begins (k steps committed)
starts on the rank's copy thread at the beginning of step k while step k's forward and backward
run: the thread first packs the live tensors into the rank's own *undo copy* (one buffer, in
process memory), then sends that; the optimizer's update of step k waits for the keeper's
acknowledgement first (:meth:`OwnerSide.wait_sent`), the rule the shared-memory snapshots follow.
Tensors that a forward pass may change (buffers, RNG states, scheduler state) are copied at once.
The undo copies (the rank's own state as each of its two newest steps began) are what a survivor
rolls back from when the rank that kept its copy was lost (:meth:`OwnerSide.undo_steps`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpointless.errors import CommAborted, StateTransferError
from checkpointless.events import get_logger
from checkpointless.state.buddy_keeper import _KEEP, _Copy
from checkpointless.state.buddy_shm import SlotPool, SlotRef
from checkpointless.state.buddy_stream import CopySender
from checkpointless.state.codec import Layout, digest
from checkpointless.state.device_copy import copy_out, host_buffer
from checkpointless.state.staging import staged_layout

__all__ = ["OwnerSide", "copy_due"]

log = get_logger()

_ABORT_POLL_S = 0.02  # an update waiting for its copy sees a job abort this soon
_ABORT_GRACE_S = 0.5  # ... and leaves this much later if the copy has not ended by itself


def copy_due(step: int, every: int, copied_in: int, generation: int) -> bool:
    """Whether a rank copies its state as ``step`` begins: every ``every`` steps, and at the first
    step of each generation (``copied_in``: the newest generation it started a copy in).

    Why the latter: a replaced keeper holds nothing, and neither does a new member's; without a
    copy at once an owner would run up to ``every`` steps with none. Every rank sees the same
    generations and steps, so all copy at the same steps, and every keeper's copy has the
    matching undo copies in the other ranks (the recovery plan needs one step every rank can
    reach)."""
    return step % every == 0 or copied_in != generation


def _packed(manifest: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """The manifest of ``manifest``'s messages (one tensor each, as staged) packed back to back
    into one message."""
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    tensors = [{**m, "msg": 0, "offset": offsets[int(m["msg"])], "solo": False} for m in manifest["tensors"]]
    return {"tree": manifest["tree"], "tensors": tensors, "messages": [sum(sizes)]}


def _pack(lay: Layout, sizes: list[int], out: torch.Tensor) -> None:
    """``lay``'s messages back to back into ``out``: one ``torch.cat`` on the host; from a GPU,
    each message on the copy stream (state/device_copy.py), landed when this returns."""
    if lay.ready is None:
        torch.cat(lay.messages, out=out)
    else:
        copy_out(lay.messages, list(out.split(sizes)), lay.ready)


class OwnerSide:
    """A rank's sending of its own copies, and its undo copies; a part of
    :class:`~checkpointless.state.buddy.BuddyCopies`, which sets the attributes shared with the
    keeper's side and opens (:meth:`~checkpointless.state.buddy.BuddyCopies.resume`) and closes
    this generation's stream to the keeper."""

    # set by BuddyCopies, shared with the keeper's side
    rank: int
    timeout: float
    shm_dir: Path | None
    _lock: threading.Lock
    cpu_s: dict[str, float]

    def _init_owner(self, keeper: int | None, every: int) -> None:
        self.every = every
        self.keeper = keeper  # who keeps this rank's copy (None: nobody, a world of one)
        self._generation = -1
        self._copied_in = -1  # the newest generation this rank's copy was started in
        self._stream: CopySender | None = None  # this generation's stream to the keeper
        # One copy thread for the rank's life, fed a copy at a time: a thread started per step
        # cost the training thread ~2 ms a step (Thread.start waits for the new thread to run,
        # behind the GIL, on a loaded machine). None on the queue ends it.
        self._jobs: queue.SimpleQueue[tuple[int, Layout, CopySender] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._sent = threading.Event()
        self._sent.set()
        self._cancel = threading.Event()
        self.last_send: dict[str, float] = {}  # the newest acknowledged copy's step, bytes, seconds
        self.failed = 0  # copies not acknowledged (keeper gone, cancelled)
        self.skipped = 0  # copies not started because the previous one was still in flight
        self.last_wait = 0.0  # seconds the last update waited for its copy (the critical-path cost)
        # This rank's own state as each of its two newest copied steps began, in process memory:
        # its undo copies (see :meth:`undo_steps`). Written by the copy thread, then sent from.
        self._undo: dict[int, _Copy] = {}
        self._last_packed: tuple[list[Any], list[int], dict[str, Any]] | None = None
        # Same-host copies (state/buddy_shm.py): this rank's files while its keeper is on its
        # host, and the files that keeper listed in its last acknowledgement (None: unknown, so
        # the next copy takes a new file)
        self._pool: SlotPool | None = None
        self._keeper_files: set[str] | None = None

    def due(self, step: int) -> bool:
        """Whether the state as ``step`` begins is to be copied (:func:`copy_due`)."""
        if self.keeper is None or self._stream is None:
            return False
        return copy_due(step, self.every, self._copied_in, self._generation)

    def start(self, step: int, state: Any, guarded: set[int], staged: Layout | None = None) -> bool:
        """Begin sending ``state`` (taken as step ``step`` begins) to the keeper. ``staged`` is
        :func:`~checkpointless.state.staging.staged_layout` of that state when the caller
        has it already (shared with the step's snapshot); otherwise it is made here."""
        stream = self._stream
        if self.keeper is None or stream is None:
            return False
        if not self._sent.is_set():
            self.skipped += 1  # never queue: the optimizer waits for one copy at most
            return False
        if staged is None:
            staged = staged_layout(state, guarded)
        lay = Layout(staged.manifest, list(staged.messages), staged.ready)  # our list: _undo_copy clears it
        self._sent.clear()
        self._cancel.clear()
        self._copied_in = self._generation
        if self._sender is None or not self._sender.is_alive():
            self._sender = threading.Thread(target=self._copies, name=f"cl-buddy-r{self.rank}", daemon=True)
            self._sender.start()
        self._jobs.put((step, lay, stream))
        return True

    def _copies(self) -> None:
        while (job := self._jobs.get()) is not None:
            t0 = time.thread_time()
            self._send(*job)
            self.cpu_s["send"] += time.thread_time() - t0

    def _packed(self, staged: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
        """:func:`_packed`, whose layout part is the previous copy's very object while the state's
        tensors are laid out alike (nearly always), so the stream encodes it once."""
        last = self._last_packed
        if last is not None and last[0] == staged["tensors"] and last[1] == sizes:
            return {**last[2], "tree": staged["tree"]}
        manifest = _packed(staged, sizes)
        self._last_packed = (staged["tensors"], sizes, manifest)
        return manifest

    def _undo_copy(self, step: int, lay: Layout) -> Layout:
        """Pack ``lay``'s messages into this rank's undo memory (the older of two slots, reused
        when the size matches) and publish it as step ``step``'s; return the packed layout.

        Why packed: one message of 5 MB instead of ~200 of 32 KB each spares, per copy, the
        owner's and the keeper's per-message work (a view, a hash, a digest in the trailer, a
        buffer each) and lets the keeper hold the bytes without rebuilding the tree every step;
        ``torch.cat`` into the slot is one call, a memory copy the undo copy needs anyway."""
        sizes = [int(m.numel()) for m in lay.messages]
        manifest = self._packed(lay.manifest, sizes)
        with self._lock:
            old = self._undo.pop(min(self._undo)) if len(self._undo) >= _KEEP else None
        # (never a copy file's buffer: its keeper may list it, state/buddy_shm.py)
        reuse = old is not None and old.slot is None and int(old.buffers[0].numel()) == sum(sizes)
        flat = old.buffers[0] if reuse and old is not None else None
        if flat is None:
            flat = host_buffer(sum(sizes), lay.ready)
        _pack(lay, sizes, flat)
        self._check_packed(step)
        lay.messages.clear()  # the live tensors are no longer read: the update may change them
        with self._lock:
            self._undo[step] = _Copy(manifest, [flat])
        return Layout(manifest, [flat])

    def _check_packed(self, step: int) -> None:
        """Refuse a copy cancelled while it was packed. The cancel comes from wait_sent giving up
        on it, after which the update may have changed tensors half-way through the packing:
        such a copy would be torn, and an undo copy is restored without a digest check."""
        if self._cancel.is_set():
            raise CommAborted(f"buddy copy of step {step} cancelled while it was packed")

    def _file_copy(self, step: int, lay: Layout, pool: SlotPool) -> tuple[Layout, SlotRef]:
        """Pack ``lay``'s messages into one of this rank's copy files (one its keeper does not
        list, nor its own two newest undo copies) and publish it as the undo copy of ``step``."""
        sizes = [int(m.numel()) for m in lay.messages]
        manifest = self._packed(lay.manifest, sizes)
        with self._lock:
            undo = {c.slot.name for c in self._undo.values() if c.slot is not None}
        known = self._keeper_files
        name, data, inode = pool.take(sum(sizes), None if known is None else known | undo)
        self._keeper_files = None  # the keeper may list this copy once it arrives: unknown until acked
        _pack(lay, sizes, data)
        self._check_packed(step)
        lay.messages.clear()  # the live tensors are no longer read: the update may change them
        ref = SlotRef(name, inode, int(data.numel()), digest(data))
        with self._lock:
            self._undo[step] = _Copy(manifest, [data], slot=ref)
            for old in sorted(self._undo)[:-_KEEP]:
                del self._undo[old]
        return Layout(manifest, [data]), ref

    def _send(self, step: int, lay: Layout, stream: CopySender) -> None:
        t0 = time.monotonic()
        nbytes = sum(int(m.numel()) for m in lay.messages)
        aborted: Callable[[], str | None] = lambda: "cancelled" if self._cancel.is_set() else None  # noqa: E731
        try:
            pool, ref = self._pool, None
            if pool is not None:
                # a keeper on this host: the copy is the file, and only its description travels
                try:
                    lay, ref = self._file_copy(step, lay, pool)
                except OSError as e:  # /dev/shm full (a container's 64 MB): the socket still works
                    log.warning(
                        "no room for buddy copy files in %s (%s); copies go over the socket", self.shm_dir, e
                    )
                    self._pool = pool = None
            if pool is not None and ref is not None:
                held = set(stream.send(step, lay, t0 + self.timeout, aborted, slot=ref))
                self._keeper_files = held
                with self._lock:
                    undo = {c.slot.name for c in self._undo.values() if c.slot is not None}
                pool.prune(held | undo)
            else:
                # Sent from this rank's undo copy, not the live tensors: the copy is made once,
                # hot in cache for the socket, and is the undo copy a survivor rolls back from
                # (its keeper lost) instead of a shared-memory snapshot every step (measured:
                # ~4 ms per rank-step).
                lay = self._undo_copy(step, lay)
                stream.send(step, lay, t0 + self.timeout, aborted)
            self.last_send = {"step": step, "bytes": float(nbytes), "send_s": time.monotonic() - t0}
        except Exception as e:  # a lost copy must not fail training: the plan knows what is kept
            self.failed += 1
            log.info("buddy copy of step %d to rank %d not acknowledged: %s", step, stream.keeper, e)
        finally:
            self._sent.set()

    def wait_sent(self, timeout: float, aborted: Callable[[], str | None] | None = None) -> float:
        """Block until the copy in flight is acknowledged (or failed); return the seconds waited.
        Past ``timeout`` the copy is cancelled (the update must not change tensors still being
        packed into the undo copy; once packed, the copy is sent from there).

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

    def undo_steps(self) -> list[int]:
        """Steps whose start this rank's own state is kept for in process memory. A survivor
        that committed past the plan's target rolls back from it when its keeper (the other
        holder of its state) was lost; reported with the rank's own snapshots."""
        with self._lock:
            return sorted(self._undo)

    def undo(self, step: int) -> Any:
        """This rank's own state as ``step`` began (from :meth:`undo_steps`)."""
        with self._lock:
            kept = self._undo.get(step)
        if kept is None:
            raise StateTransferError(f"this rank keeps no undo copy of step {step}")
        return kept.tree()

    def forget_after(self, step: int) -> None:
        """After a roll back to ``step``: undo copies of later steps are of an abandoned run."""
        with self._lock:
            for s in [s for s in self._undo if s > step]:
                del self._undo[s]

    @property
    def undo_bytes(self) -> int:
        with self._lock:
            return sum(int(b.numel()) for k in self._undo.values() for b in k.buffers)

    @property
    def file_bytes(self) -> int:
        """The shared memory this rank's copy files take (its undo copies and a spare)."""
        pool = self._pool
        return pool.nbytes() if pool is not None else 0

    @property
    def transport(self) -> str:
        """How this rank's copies reach its keeper: "file" (same host) or "socket"."""
        return "file" if self._pool is not None else "socket"
