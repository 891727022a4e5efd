"""Peer state over one direct TCP stream per receiver, on the port the source already serves.

Why not the gloo group: gloo moves a point-to-point message at 40-90% of what the same socket
does from Python, and the state transfer sits on the critical path of every replacement. Here
the receiver connects to the source's rendezvous key server (already listening, on a port from
the job's range, so no new port has to be opened or allowed), authenticates like any rendezvous
request (sealed with the job secret, with a server-issued nonce, so it cannot be replayed), and
the server hands the connection over to the transfer.

On the stream: a sealed frame with the manifest, the messages as raw bytes, a sealed frame with
the XXH3-128 digests, and the receiver's sealed acknowledgement. This module holds the route, the
hand-over and that exchange; how the frames and bytes move, each wait sliced so that an abort or
the deadline ends the transfer promptly, is ``stream_io.py``, and how the digests are computed as
the bytes move (inline or on a helper thread) is ``stream_hash.py``.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.rendezvous.keyproto import KEYSERVER_C2S, KEYSERVER_S2C, PROTOCOL_VERSION
from checkpointless.rendezvous.peers import parse_address
from checkpointless.rendezvous.server import KeyServer
from checkpointless.state.arena import Arena
from checkpointless.state.codec import Layout, digest, mismatch, receive_buffers
from checkpointless.state.manifest import parse_manifest
from checkpointless.state.stream_io import (
    POLL,
    Aborted,
    check,
    read_frame,
    recv_messages,
    send_messages,
    write_frame,
)
from checkpointless.wire import derive_key, send_frame

__all__ = [
    "StreamRoute",
    "open_stream",
    "stream_receive",
    "stream_send",
]


@dataclass(frozen=True)
class StreamRoute:
    """How this generation's ranks reach each other's key servers."""

    server: KeyServer  # this process's: a source accepts its receivers here
    peers: list[str]  # rank -> key server address
    secret: bytes
    channel: str  # unique per generation, e.g. "state/gen3"

    # A stream is a key-server connection handed over, so it keeps that connection's keys:
    # the receiver (the connection's client) seals with the request key, the source with the reply key.
    @property
    def request_key(self) -> bytes:
        return derive_key(self.secret, KEYSERVER_C2S)

    @property
    def reply_key(self) -> bytes:
        return derive_key(self.secret, KEYSERVER_S2C)


def stream_send(
    route: StreamRoute,
    lay: Layout,
    mbytes: bytes,
    receivers: list[int],
    deadline: float,
    aborted: Aborted,
) -> None:
    """Send ``lay`` to every receiver, each on the stream it opens to us."""
    accepted = route.server.open_channel(route.channel)
    socks: dict[int, socket.socket] = {}
    try:
        while len(socks) < len(receivers):
            check(deadline, aborted, f"waiting for receivers {sorted(set(receivers) - set(socks))}")
            try:
                sock, request = accepted.get(timeout=POLL)
            except queue.Empty:
                continue
            rank = request.get("rank")
            if not isinstance(rank, int) or rank not in receivers or rank in socks:
                sock.close()  # not a receiver of this plan: nothing for it
                continue
            sock.settimeout(POLL)
            socks[rank] = sock
        for sock in socks.values():
            write_frame(sock, route.reply_key, deadline, {"type": "manifest"}, mbytes)
        digests = [digest(mbytes), *send_messages(list(socks.values()), lay.messages, deadline, aborted)]
        for sock in socks.values():
            write_frame(sock, route.reply_key, deadline, {"type": "trailer", "digests": digests})
        for rank, sock in socks.items():
            ack = read_frame(sock, route.request_key, deadline, aborted, f"rank {rank}'s acknowledgement")
            if ack.get("ok") is not True:
                raise StateTransferError(f"rank {rank} refused the state: {ack.get('error')}")
    except OSError as e:
        raise StateTransferError(f"state stream to a receiver broke: {e}") from e
    finally:
        route.server.close_channel(route.channel)
        for sock in socks.values():
            sock.close()


def open_stream(route: StreamRoute, src: int, rank: int, deadline: float, aborted: Aborted) -> socket.socket:
    host, port = parse_address(route.peers[src])
    try:
        sock = socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
    except OSError as e:
        raise StateTransferError(f"cannot reach the state source, rank {src} at {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(POLL)
        send_frame(sock, route.request_key, {"op": "hello", "seq": 1})
        hello = read_frame(sock, route.reply_key, deadline, aborted, "the handshake")
        if hello.get("v") != PROTOCOL_VERSION or not isinstance(hello.get("nonce"), str):
            raise StateTransferError(f"rank {src} answered the handshake with {hello}")
        seq = 1
        while True:  # the source opens its channel once it has laid its state out: retry till then
            seq += 1
            request = {"op": "stream", "seq": seq, "nonce": hello["nonce"], "channel": route.channel}
            send_frame(sock, route.request_key, {**request, "rank": rank})
            reply = read_frame(sock, route.reply_key, deadline, aborted, "the stream request")
            if reply.get("ok") is True:
                return sock
            if reply.get("error") != "no-channel":
                raise StateTransferError(f"rank {src} refused the state stream: {reply}")
            time.sleep(0.005)
            check(deadline, aborted, f"waiting for rank {src} to send")
    except BaseException:
        sock.close()
        raise


def stream_receive(
    route: StreamRoute,
    src: int,
    rank: int,
    deadline: float,
    aborted: Aborted,
    into: Any,
    arena: Arena | None,
) -> tuple[dict[str, Any], list[torch.Tensor], dict[str, float]]:
    """Receive from ``src``; return the manifest, the verified messages and timings. Large
    tensors land in ``into``'s tensors of the same path where they fit (receive_buffers)."""
    t0 = time.monotonic()
    sock = open_stream(route, src, rank, deadline, aborted)
    try:
        head = read_frame(sock, route.reply_key, deadline, aborted, "the manifest")
        mbytes = head.get("payload", b"")
        manifest = parse_manifest(mbytes)  # checked before any buffer is allocated from it
        buffers, in_place = receive_buffers(manifest, into, arena)
        got = [digest(mbytes), *recv_messages(sock, buffers, deadline, aborted)]
        t1 = time.monotonic()
        trailer = read_frame(sock, route.reply_key, deadline, aborted, "the digests")
        expected = trailer.get("digests")
        bad = mismatch(got, expected)
        with contextlib.suppress(OSError):
            write_frame(sock, route.request_key, deadline, {"ok": bad is None, "error": bad})
        if bad is not None:
            raise StateTransferError(f"state from rank {src}: {bad}")
    except OSError as e:
        raise StateTransferError(f"state stream from rank {src} broke: {e}") from e
    finally:
        sock.close()
    nbytes = sum(int(b.numel()) for b in buffers) + len(mbytes)
    return manifest, buffers, {"recv_s": t1 - t0, "bytes": float(nbytes), "in_place_bytes": float(in_place)}
