"""Bytes on a state stream: sealed frames and the messages' raw bytes, under a deadline and an abort.

Separate from ``stream.py`` (how a state stream is opened, and the exchange it carries) because
the buddy copies' kept stream (``buddy_stream.py``) moves its frames and messages the same way
over a connection of its own; this module knows nothing of who opened the socket.

Messages: consecutive small ones go together, many buffers per system call (scatter-gather); a
large one goes alone, and each piece a socket call moved is handed at once to the digests'
:class:`~checkpointless.state.stream_hash.Hasher` while it is still in cache.

Every wait is sliced (``POLL``) so that an abort (a newer fault) or the deadline ends the
transfer within a fraction of a second, even when the peer is stopped rather than dead.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.stream_hash import Hasher, hash_on_thread
from checkpointless.wire import FrameError, recv_frame, send_frame

__all__ = [
    "POLL",
    "Aborted",
    "check",
    "read_frame",
    "recv_messages",
    "send_messages",
    "write_frame",
]

_CHUNK = 4 << 20  # a message this large goes alone; smaller ones go together, up to this much
_PIECE = 16 << 20  # the most one socket call is offered; the kernel takes what fits its buffer
POLL = 0.25
_MAX_MANIFEST = 1 << 30  # a frame's cap; a manifest lists every tensor, so it can be megabytes
_IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux's IOV_MAX)

Aborted = Callable[[], "str | None"]


def check(deadline: float, aborted: Aborted, what: str) -> None:
    reason = aborted()
    if reason is not None:
        raise StateTransferError(f"state transfer aborted during {what}: {reason}")
    if time.monotonic() > deadline:
        raise StateTransferError(f"state transfer timed out during {what}")


def _send_group(sock: socket.socket, views: list[memoryview], deadline: float, aborted: Aborted) -> None:
    """Send buffers in order, many small ones per system call (scatter-gather)."""
    views = [v for v in views if len(v)]
    while views:
        try:
            n = sock.sendmsg(views[:_IOV_MAX])
        except TimeoutError:
            check(deadline, aborted, "sending")
            continue
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def _recv_group(sock: socket.socket, views: list[memoryview], deadline: float, aborted: Aborted) -> None:
    """Fill buffers in order, many small ones per system call."""
    views = [v for v in views if len(v)]
    while views:
        try:
            n = sock.recvmsg_into(views[:_IOV_MAX])[0]
        except TimeoutError:
            check(deadline, aborted, "receiving")
            continue
        if n == 0:
            raise StateTransferError("the state source closed the stream early: it has died")
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def _send_hashed(
    socks: list[socket.socket], view: memoryview, hasher: Hasher, deadline: float, aborted: Aborted
) -> None:
    """Send one large message to every socket, feeding the hasher piece by piece.

    The first socket sets the pace: each piece is what one ``send`` took, given to the hasher
    right after (while it is in cache); the other receivers, if any, get the same piece in full."""
    first, rest = socks[0], socks[1:]
    off = 0
    while off < len(view):
        try:
            n = first.send(view[off : off + _PIECE])
        except TimeoutError:
            check(deadline, aborted, "sending")
            continue
        piece = view[off : off + n]
        hasher.update(piece)
        for sock in rest:
            _send_group(sock, [piece], deadline, aborted)
        off += n
        check(deadline, aborted, "sending")  # a receiver that trickles never times a call out
    hasher.end()


def _recv_hashed(
    sock: socket.socket, view: memoryview, hasher: Hasher, deadline: float, aborted: Aborted
) -> None:
    """Fill one large message, feeding the hasher each piece as soon as it has arrived."""
    off = 0
    while off < len(view):
        try:
            n = sock.recv_into(view[off : off + _PIECE])
        except TimeoutError:
            check(deadline, aborted, "receiving")
            continue
        if n == 0:
            raise StateTransferError("the state source closed the stream early: it has died")
        hasher.update(view[off : off + n])
        off += n
        check(deadline, aborted, "receiving")
    hasher.end()


def _groups(messages: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive small messages go together (up to a chunk's worth); a large one goes alone."""
    out: list[list[int]] = []
    small: list[int] | None = None  # the group of small messages being filled, if any
    size = 0
    for i, m in enumerate(messages):
        n = int(m.numel())
        if n >= _CHUNK:
            out.append([i])
            small = None
            continue
        if small is None or size + n > _CHUNK or len(small) >= _IOV_MAX:
            small = []
            out.append(small)
            size = 0
        small.append(i)
        size += n
    return out


def read_frame(
    sock: socket.socket, secret: bytes, deadline: float, aborted: Aborted, what: str
) -> dict[str, Any]:
    """The next sealed frame, waiting in slices so that an abort is noticed."""
    poller = select.poll()  # not select.select: a large job's process holds fds past FD_SETSIZE
    poller.register(sock, select.POLLIN)
    while not poller.poll(POLL * 1000):
        check(deadline, aborted, what)
    try:
        header, payload = recv_frame(sock, secret, deadline, max_payload=_MAX_MANIFEST)
    except (FrameError, OSError) as e:
        hint = ""
        if what == "the handshake" and "closed" in str(e):
            # a key server closes, unanswered, a request that fails authentication
            hint = " (the source died, or refused our authentication: wrong job secret?)"
        raise StateTransferError(f"state stream broke during {what}: {e}{hint}") from e
    finally:
        sock.settimeout(POLL)  # recv_frame set the deadline's timeout; the data phase polls
    if payload:
        header["payload"] = bytes(payload)
    return header


def write_frame(
    sock: socket.socket, secret: bytes, deadline: float, header: dict[str, Any], payload: bytes = b""
) -> None:
    """A sealed frame, bounded by the deadline (a manifest can be megabytes), then back to polling."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        send_frame(sock, secret, header, payload)
    finally:
        sock.settimeout(POLL)


def send_messages(
    socks: list[socket.socket], messages: list[torch.Tensor], deadline: float, aborted: Aborted
) -> list[str]:
    """Every message's raw bytes to every socket, in order; their XXH3-128 digests."""
    hasher = Hasher(hash_on_thread())
    try:
        for group in _groups(messages):
            views = [memoryview(messages[i].numpy()).cast("B") for i in group]
            if len(views[0]) < _CHUNK:  # small ones: sent together, then hashed one by one
                for sock in socks:
                    _send_group(sock, views, deadline, aborted)
                for v in views:
                    hasher.message(v)
                continue
            _send_hashed(socks, views[0], hasher, deadline, aborted)
        return hasher.digests(deadline)
    finally:
        hasher.close()


def recv_messages(
    sock: socket.socket, buffers: list[torch.Tensor], deadline: float, aborted: Aborted
) -> list[str]:
    """Fill every buffer from the socket, in order; the digests of what arrived."""
    hasher = Hasher(hash_on_thread())
    try:
        for group in _groups(buffers):
            views = [memoryview(buffers[i].numpy()).cast("B") for i in group]
            if len(views[0]) < _CHUNK:
                _recv_group(sock, views, deadline, aborted)
                for v in views:
                    hasher.message(v)
                continue
            _recv_hashed(sock, views[0], hasher, deadline, aborted)
        return hasher.digests(deadline)
    finally:
        hasher.close()
