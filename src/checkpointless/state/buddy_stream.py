"""One persistent stream per generation from an owner to its keeper, for the per-step buddy copies.

Why not one state stream (state/stream.py) per copy: each copy then paid for a connection, a
handshake, a manifest parsed and checked, and above all the keeper asking the owner's key server
every few milliseconds whether the next copy had begun (a sealed request and reply each, on both
ranks' CPU, the CPU the training lacks). Measured in one process, 5.2 MB in 214 tensors: 20 ms of
CPU per copy at a 0.1 s step and 28 ms at 0.3 s, the difference being the polling.

Here the keeper connects once per generation, through the owner's key server as any stream does
(authenticated, nonce-checked), and then blocks on the socket: the next copy's first frame wakes
it, costing nothing while it waits. Each copy is: a sealed ``copy`` frame (the copy's sequence
number on this connection, its step, the manifest), the messages' raw bytes, a sealed trailer
with the XXH3-128 digest of the manifest's parts and of every message, and the keeper's sealed
acknowledgement naming the sequence number (a replayed or reordered frame is an error, not a copy).

The manifest travels in two parts: the *tree* (the state's skeleton and its numbers: the step,
the learning rate) with every copy, and the *layout* (every tensor's path, dtype, shape and
message) only when it differs from the one the connection carried last, which on a training job
is once per connection. The keeper checks the tree per copy and the layout once, and lands a copy
in the buffers of the older copy it replaces when their layouts match (:attr:`Copy.layout`), so a
steady stream allocates and validates nearly nothing. Keeper CPU per copy this removed (5.2 MB in
214 tensors): manifest parsed and checked 3.0 ms, landing buffers found 1.9 ms.

A same-host owner sends no bytes (state/buddy_shm.py): its ``copy`` frame names the file that
holds the copy (name, inode, size), the trailer carries that file's digest, which the keeper keeps
to check when the copy is used, and every acknowledgement names the files the keeper lists, which
the owner then never writes.

Any error ends the connection on both sides; the keeper connects again (the owner takes the newest
connection from its channel), and the next copy carries its layout again. A copy cut off is never
acknowledged, and never listed by the keeper (state/buddy_keeper.py).
"""

from __future__ import annotations

import contextlib
import json
import queue
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.buddy_shm import SlotRef, check_slot_name
from checkpointless.state.codec import Layout, digest, mismatch, receive_buffers
from checkpointless.state.manifest import check_manifest, check_tree
from checkpointless.state.stream import StreamRoute, open_stream
from checkpointless.state.stream_io import read_frame, recv_messages, send_messages, write_frame

__all__ = ["Copy", "CopyReceiver", "CopySender"]

Aborted = Callable[[], "str | None"]
_POLL_S = 0.25  # a keeper waiting for the next copy sees its stop this soon


def _json(v: Any) -> bytes:
    return json.dumps(v, separators=(",", ":"), allow_nan=True).encode()


@dataclass
class Copy:
    """One verified copy, as the keeper received it."""

    step: int
    manifest: dict[str, Any]
    buffers: list[torch.Tensor]  # one per message, verified (none when the copy lies in a file)
    layout: str  # digest of the layout part: copies with the same one fit each other's buffers
    slot: SlotRef | None = None  # a same-host copy: the owner's file (state/buddy_shm.py)
    tree_bytes: bytes = b""  # ... and its tree, not yet parsed (manifest["tree"] is None): see parse_tree

    def parse_tree(self) -> dict[str, Any]:
        """The manifest with the tree of a copy that lies in a file, parsed and checked now."""
        if self.manifest["tree"] is not None:
            return self.manifest
        tree = parse_tree(self.tree_bytes, len(self.manifest["tensors"]))
        if not isinstance(tree, dict) or tree.get("step") != self.step:
            raise StateTransferError(f"the copy of step {self.step} holds another step")
        return {**self.manifest, "tree": tree}


def parse_tree(tree_bytes: bytes, n_tensors: int) -> Any:
    """A copy's tree from its JSON, checked against the layout's tensor count."""
    try:
        tree = json.loads(tree_bytes)
    except (ValueError, RecursionError) as e:
        raise StateTransferError(f"a buddy copy has a malformed tree: {e}") from e
    check_tree(tree, n_tensors)
    return tree


class CopySender:
    """The owner's end: accepts its keeper's connection on the generation's channel, then sends
    one copy per call over it. Used from one thread at a time (the copy thread)."""

    def __init__(self, route: StreamRoute, keeper: int) -> None:
        self.route = route
        self.keeper = keeper
        self._accepted = route.server.open_channel(route.channel)
        self._sock: socket.socket | None = None
        self._seq = 0
        self._layout: bytes | None = None  # the layout the keeper last received on this connection
        self._encoded: tuple[Any, Any, bytes, str] | None = None  # the last layout objects, encoded

    def _take_newest(self) -> None:
        """A keeper that connected again (after an error on its side) replaces the old stream."""
        while True:
            try:
                sock, request = self._accepted.get_nowait()
            except queue.Empty:
                return
            if request.get("rank") != self.keeper:
                sock.close()  # not our keeper: nothing for it on this channel
                continue
            self._drop()
            sock.settimeout(_POLL_S)
            self._sock = sock
            self._seq = 0  # numbered per connection, as the keeper counts them

    def _connected(self, deadline: float, aborted: Aborted) -> socket.socket:
        self._take_newest()
        while self._sock is None:
            reason = aborted()
            if reason is not None:
                raise StateTransferError(f"buddy copy cancelled: {reason}")
            if time.monotonic() > deadline:
                raise StateTransferError(f"rank {self.keeper} did not connect to keep our copies")
            try:
                got = self._accepted.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                continue
            self._accepted.put(got)  # handled with any others that queued meanwhile
            self._take_newest()
        return self._sock

    def send(
        self, step: int, lay: Layout, deadline: float, aborted: Aborted, slot: SlotRef | None = None
    ) -> list[str]:
        """Send one copy and wait for the keeper's acknowledgement; return the copy files the
        keeper lists now (a same-host keeper's). With ``slot`` the bytes are not sent: they lie in
        that file (written before the call), and only its description and digest travel.
        Raises StateTransferError."""
        sock = self._connected(deadline, aborted)
        self._seq += 1
        tree = _json(lay.manifest["tree"])
        parts = (lay.manifest["tensors"], lay.manifest["messages"])
        if self._encoded is None or self._encoded[0] is not parts[0] or self._encoded[1] is not parts[1]:
            # the same layout objects as the last copy's (state/buddy_owner.py keeps them): encoded once
            layout = _json({"tensors": parts[0], "messages": parts[1]})
            self._encoded = (parts[0], parts[1], layout, digest(layout))
        layout, ldigest = self._encoded[2], self._encoded[3]
        payload = tree if layout == self._layout else tree + layout
        header: dict[str, Any] = {
            "type": "copy",
            "seq": self._seq,
            "step": step,
            "tree": len(tree),
            "layout": ldigest,
        }
        if slot is not None:
            header["file"] = {"name": slot.name, "inode": slot.inode, "nbytes": slot.nbytes}
        try:
            write_frame(sock, self.route.reply_key, deadline, header, payload)
            self._layout = layout
            if slot is not None:
                digests = [digest(tree), ldigest, slot.digest]
            else:
                digests = [digest(tree), ldigest, *send_messages([sock], lay.messages, deadline, aborted)]
            write_frame(sock, self.route.reply_key, deadline, {"type": "trailer", "digests": digests})
            ack = read_frame(sock, self.route.request_key, deadline, aborted, "the keeper's acknowledgement")
        except (OSError, StateTransferError) as e:
            self._drop()
            raise StateTransferError(f"buddy copy of step {step} to rank {self.keeper} broke: {e}") from e
        held = ack.get("held", [])
        if ack.get("seq") != self._seq or ack.get("ok") is not True or not isinstance(held, list):
            self._drop()
            raise StateTransferError(f"rank {self.keeper} refused the copy of step {step}: {ack}")
        return [str(h) for h in held]

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._layout = None

    def close(self) -> None:
        self.route.server.close_channel(self.route.channel)
        self._drop()


class CopyReceiver:
    """The keeper's end: one connection to the owner, kept; one copy per :meth:`receive`."""

    def __init__(self, route: StreamRoute, owner: int, rank: int) -> None:
        self.route = route
        self.owner = owner
        self.rank = rank
        self._sock: socket.socket | None = None
        self._seq = 0
        self._layout: tuple[str, dict[str, Any]] | None = None  # digest and checked layout, reused

    def _wait_readable(self, sock: socket.socket, stopped: Aborted) -> None:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while not poller.poll(_POLL_S * 1000):
            reason = stopped()
            if reason is not None:
                raise StateTransferError(f"no longer keeping rank {self.owner}'s copies: {reason}")

    def receive(
        self,
        timeout: float,
        stopped: Aborted,
        landing: Callable[[str], list[torch.Tensor] | None],
        keep: Callable[[Copy], list[str]],
        cpu: dict[str, float] | None = None,
    ) -> Copy:
        """Wait (with no deadline, until ``stopped``) for the owner's next copy; receive it within
        ``timeout`` of its first frame. ``landing(layout)``, called once the copy has begun, may
        return the buffers of an older copy of that layout to receive into; otherwise new ones
        are made. ``keep(copy)`` lists a verified copy before it is acknowledged and returns the
        copy files now listed, which the acknowledgement names (the owner writes none of them).
        A copy that lies in a file (a same-host owner) carries no bytes: its digest is kept and
        checked when it is used. Raises StateTransferError (the connection is then closed; the
        next call opens another)."""
        try:
            if self._sock is None:
                self._sock = open_stream(
                    self.route, self.owner, self.rank, time.monotonic() + timeout, stopped
                )
                self._seq = 0
                self._layout = None
            sock = self._sock
            self._wait_readable(sock, stopped)
            t0 = time.thread_time()  # this thread's CPU for the copy, kept in ``cpu["keep"]``
            deadline = time.monotonic() + timeout
            head = read_frame(sock, self.route.reply_key, deadline, stopped, "the copy's header")
            self._seq += 1
            step, tree_len = head.get("step"), head.get("tree")
            if head.get("type") != "copy" or head.get("seq") != self._seq:
                raise StateTransferError(f"expected copy {self._seq} from rank {self.owner}, got {head}")
            if not isinstance(step, int) or not isinstance(tree_len, int):
                raise StateTransferError(f"rank {self.owner}'s copy names no step or tree: {head}")
            payload = head.get("payload", b"")
            tree_bytes = payload[:tree_len]
            file = head.get("file")
            # a copy in a file is read only if it is used: its tree is parsed and checked then
            ldigest, manifest = self._manifest_of(
                str(head.get("layout")), tree_bytes, payload[tree_len:], parse=file is None
            )
            slot: SlotRef | None = None
            if file is not None:
                slot = self._slot_of(file, manifest)
                buffers: list[torch.Tensor] = []
                got = [digest(tree_bytes), ldigest]
            else:
                buffers = landing(ldigest) or receive_buffers(manifest)[0]
                got = [digest(tree_bytes), ldigest, *recv_messages(sock, buffers, deadline, stopped)]
            trailer = read_frame(sock, self.route.reply_key, deadline, stopped, "the digests")
            expected = trailer.get("digests")
            if slot is not None and isinstance(expected, list) and len(expected) == 3:
                # the file's bytes are checked against this when the copy is used
                slot = SlotRef(slot.name, slot.inode, slot.nbytes, str(expected[2]))
                expected = expected[:2]
            bad = mismatch(got, expected)
            copy = Copy(step, manifest, buffers, ldigest, slot, tree_bytes if slot is not None else b"")
            held = keep(copy) if bad is None else []
            with contextlib.suppress(OSError):
                write_frame(
                    sock,
                    self.route.request_key,
                    deadline,
                    {"seq": self._seq, "ok": bad is None, "error": bad, "held": held},
                )
            if cpu is not None:
                cpu["keep"] = cpu.get("keep", 0.0) + time.thread_time() - t0
            if bad is not None:
                raise StateTransferError(f"buddy copy of step {step} from rank {self.owner}: {bad}")
            return copy
        except OSError as e:
            self.close()
            raise StateTransferError(f"buddy stream from rank {self.owner} broke: {e}") from e
        except StateTransferError:
            self.close()
            raise

    def _slot_of(self, file: Any, manifest: dict[str, Any]) -> SlotRef:
        """A same-host copy's file, as announced: a name of the owner's own, and the size its
        manifest needs (the digest comes with the trailer)."""
        if not isinstance(file, dict):
            raise StateTransferError(f"rank {self.owner}'s copy names its file wrongly: {file!r}")
        name = check_slot_name(file.get("name"), self.owner)
        inode, nbytes = file.get("inode"), file.get("nbytes")
        if not isinstance(inode, int) or not isinstance(nbytes, int):
            raise StateTransferError(f"rank {self.owner}'s copy file has no inode or size: {file!r}")
        if [nbytes] != manifest["messages"]:
            raise StateTransferError(f"rank {self.owner}'s copy file holds {nbytes} bytes, not its layout's")
        return SlotRef(name, inode, nbytes, "")

    def _manifest_of(
        self, ldigest: str, tree_bytes: bytes, layout: bytes, parse: bool = True
    ) -> tuple[str, dict[str, Any]]:
        """The copy's manifest, checked: its layout sent with it or (same digest) the one this
        connection carried last; its tree always sent (left unparsed, None, unless ``parse``)."""
        if layout:
            if digest(layout) != ldigest:
                raise StateTransferError(f"rank {self.owner}'s copy layout does not match its digest")
            try:
                parts = json.loads(layout)
            except (ValueError, RecursionError) as e:
                raise StateTransferError(f"rank {self.owner}'s copy has a malformed layout: {e}") from e
            if not isinstance(parts, dict):
                raise StateTransferError(f"rank {self.owner}'s copy layout is not an object")
            # checked before any buffer is allocated from it (its tree comes with each copy)
            self._layout = (ldigest, check_manifest({**parts, "tree": None}))
        if self._layout is None or self._layout[0] != ldigest:
            raise StateTransferError(f"rank {self.owner}'s copy refers to a layout never sent")
        checked = self._layout[1]
        tree = parse_tree(tree_bytes, len(checked["tensors"])) if parse else None
        return ldigest, {"tensors": checked["tensors"], "messages": checked["messages"], "tree": tree}

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._layout = None
