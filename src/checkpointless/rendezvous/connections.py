"""A key server's connections: what each one has proved so far, and the counters of them all.

A connection is trusted frame by frame (server.py says why): its first sealed frame lifts the
cap on what it may announce, a request that changes a key must carry the nonce this
connection's ``hello`` issued, and sequence numbers only rise. The loop that reads and sends
frames is :class:`~checkpointless.rendezvous.server.KeyServer`; the rule for what a sealed
frame's header must show is here, beside the state it reads.
"""

from __future__ import annotations

import secrets
import socket
from typing import Any

from checkpointless.rendezvous.keyproto import MUTATING_OPS
from checkpointless.rendezvous.server_requests import Pending
from checkpointless.wire import FrameDecoder

__all__ = ["Connection", "ServerStats"]

_MAX_PAYLOAD = 64 << 20  # rendezvous values are addresses and ids; more is a bug or an attack
# A connection's first frame is a hello or a read (a write needs the nonce a hello issues), so
# it has no payload to speak of: until a frame has passed its seal, a connection may announce
# only this much, and a flood of connections that never authenticate buffers little each.
_FIRST_MAX_PAYLOAD = 64 << 10


class ServerStats:
    """Load counters of one key server (read by the benchmarks; written by the loop only)."""

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "connections",
        "peak_connections",
        "rejected",
        "requests",
        "unsealed_closed",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.connections = 0
        self.peak_connections = 0
        self.rejected = 0  # connections closed for a bad seal, a missing nonce or a replayed sequence
        self.unsealed_closed = 0  # connections closed before their first sealed frame (idle or flood)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Connection:
    """One client connection of a key server: its socket, the frame it is assembling, and the
    nonce and sequence its requests are checked against."""

    __slots__ = ("_rx_key", "accepted", "decoder", "last_seq", "nonce", "partial_since", "pending", "sock")

    def __init__(self, sock: socket.socket, rx_key: bytes, accepted: float) -> None:
        self.sock = sock
        self.accepted = accepted
        self._rx_key = rx_key
        self.nonce: str | None = None  # issued by the first "hello" on this connection
        self.last_seq = 0
        self.pending: set[Pending[Connection]] = set()  # parked by the request handler
        self.decoder = FrameDecoder(rx_key, max_payload=_FIRST_MAX_PAYLOAD)
        self.partial_since: float | None = None  # when the frame in progress started arriving

    def admits(self, header: dict[str, Any]) -> bool:
        """Whether a sealed frame's request may be served: its sequence is above every earlier
        one, and a request that changes a key carries the nonce this connection was issued."""
        seq, op = header.get("seq"), header.get("op")
        if not isinstance(seq, int) or seq <= self.last_seq:
            return False
        return op not in MUTATING_OPS or (self.nonce is not None and header.get("nonce") == self.nonce)

    def served(self, seq: int) -> bool:
        """Record an admitted request's sequence; True for the connection's first sealed frame,
        after which it may send values of any allowed size."""
        first = self.last_seq == 0
        if first:
            self.decoder = FrameDecoder(self._rx_key, max_payload=_MAX_PAYLOAD)
        self.last_seq = seq
        return first

    def issue_nonce(self) -> str:
        """The nonce a ``hello`` is answered with: one per connection, issued by the first."""
        if self.nonce is None:
            self.nonce = secrets.token_hex(16)
        return self.nonce
