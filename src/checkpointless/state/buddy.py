"""Buddy copies: every rank's shard state, kept in the memory of a rank on another host.

Why: on a sharded mesh without a replica (plain FSDP, ``R = 1``), a rank's shard exists nowhere
else, so losing the process loses the shard. Each rank therefore streams its state (the same tree
a peer would send: its local shards, optimizer state, RNG, step) to its *keeper*, the rank one host
over (state/buddy_ring.py), once per step. The recovery plan (recovery/decisions.py) then names
the keeper as the source of the lost rank's shard.

When, and why the copy is consistent: the copy of the state as step k begins (k steps committed)
starts on the rank's copy thread at the beginning of step k while step k's forward and backward
run: the thread first packs the live tensors into the rank's own *undo copy* (one buffer, in
process memory), then sends that; the optimizer's update of step k waits for the keeper's
acknowledgement first (:meth:`BuddyCopies.wait_sent`), the rule the shared-memory snapshots follow.
Tensors that a forward pass may change (buffers, RNG states, scheduler state) are copied at once.
The undo copies (the rank's own state as each of its two newest steps began) are what a survivor
rolls back from when the rank that kept its copy was lost (:meth:`BuddyCopies.undo_steps`).

Transport: one stream per generation from owner to keeper (state/buddy_stream.py), opened through
the owner's own key server, kept open, and verified with XXH3-128 like any state transfer; never
the training group (so a copy never queues behind a collective, nor a collective behind it). A
keeper on the owner's own host gets no bytes on it: the owner's undo copies are then files in the
job's shared-memory directory, which outlive the owner's process as the keeper's memory would, and
the stream carries only which file holds the copy and its digest (state/buddy_shm.py), checked
when the copy is used.

What a keeper holds: the two newest *verified* copies per owner, as bytes (the tree is rebuilt
only when a copy is used). A new copy lands in the older one's buffer, which is unlisted the
moment the owner's copy begins to arrive (not before: between copies both stay listed), so a
transfer cut off by a fault never leaves a half-written copy listed, and the newest verified one
always survives. Memory: two times the owner's state per keeper (``extra_bytes``) and two times
the rank's own (``undo_bytes``); with a same-host keeper, none in the keeper and three times the
rank's own state in its files (two undo copies and the one the next copy is written into).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpointless.errors import CommAborted, StateTransferError
from checkpointless.events import get_logger
from checkpointless.rendezvous.peers import parse_address
from checkpointless.state.buddy_shm import SlotPool, SlotRef, read_slot, writer_of
from checkpointless.state.buddy_stream import Copy, CopyReceiver, CopySender
from checkpointless.state.codec import Layout, digest, unpack
from checkpointless.state.device_copy import copy_out, host_buffer
from checkpointless.state.staging import staged_layout
from checkpointless.state.stream import StreamRoute

__all__ = ["BuddyCopies", "copy_channel", "copy_due", "keep_channel"]


def _host(address: str) -> str:
    return parse_address(address)[0]


log = get_logger()

_KEEP = 2  # verified copies kept per owner
_RETRY_S = 0.05  # a keeper whose owner is unreachable (dead, not started) tries again this often
_ABORT_POLL_S = 0.02  # an update waiting for its copy sees a job abort this soon
_ABORT_GRACE_S = 0.5  # ... and leaves this much later if the copy has not ended by itself


def keep_channel(generation: int, owner: int) -> str:
    """The stream channel an owner's per-step copy travels on."""
    return f"buddy/gen{generation}/r{owner}"


def copy_channel(generation: int, receiver: int) -> str:
    """The channel a keeper sends a kept copy back to its owner on during a recovery."""
    return f"state/gen{generation}/copy-r{receiver}"


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


class BuddyCopies:
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
        self.every = every
        self.keeper = keeper  # who keeps this rank's copy (None: nobody, a world of one)
        self.owners = owners  # whose copies this rank keeps
        self.timeout = timeout
        self._generation = -1
        self._copied_in = -1  # the newest generation this rank's copy was started in
        self._stream: CopySender | None = None  # this generation's stream to the keeper
        self._lock = threading.Lock()
        self._held: dict[int, dict[int, _Copy]] = {o: {} for o in owners}  # owner -> step -> copy
        # One copy thread for the rank's life, fed a copy at a time: a thread started per step
        # cost the training thread ~2 ms a step (Thread.start waits for the new thread to run,
        # behind the GIL, on a loaded machine). None on the queue ends it.
        self._jobs: queue.SimpleQueue[tuple[int, Layout, CopySender] | None] = queue.SimpleQueue()
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
        # This rank's own state as each of its two newest copied steps began, in process memory:
        # its undo copies (see :meth:`undo_steps`). Written by the copy thread, then sent from.
        self._undo: dict[int, _Copy] = {}
        self._last_packed: tuple[list[Any], list[int], dict[str, Any]] | None = None
        # CPU seconds spent so far: laying out (the training thread's), sending, keeping
        self.cpu_s = {"stage": 0.0, "send": 0.0, "keep": 0.0}
        # Same-host copies (state/buddy_shm.py): the directory both ends share, this rank's
        # files while its keeper is on its host, and the files that keeper listed in its last
        # acknowledgement (None: unknown, so the next copy takes a new file)
        self.shm_dir = shm_dir
        self._pool: SlotPool | None = None
        self._keeper_files: set[str] | None = None

    # -- the owner's side ------------------------------------------------------------------------
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

    # -- the keeper's side -----------------------------------------------------------------------
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
    def kept_copies(self) -> int:
        with self._lock:
            return sum(len(steps) for steps in self._held.values())

    @property
    def transport(self) -> str:
        """How this rank's copies reach its keeper: "file" (same host) or "socket"."""
        return "file" if self._pool is not None else "socket"

    @property
    def extra_bytes(self) -> int:
        """The memory the kept copies take now (at most two per owner)."""
        with self._lock:
            kept = [k for steps in self._held.values() for k in steps.values()]
        return sum(int(b.numel()) for k in kept for b in k.buffers)
