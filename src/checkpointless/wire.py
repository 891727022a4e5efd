"""Authenticated framing for every socket that checkpointless opens.

A frame is a JSON header plus an optional binary payload, sealed with an HMAC-SHA256 of the
per-job secret. The receiver checks the seal *before* it parses anything, so a process that does
not know the secret can neither inject control messages nor make us decode its bytes. Nothing is
ever unpickled from a socket.

Layout (big-endian)::

    u32 header_len | u64 payload_len | 32-byte HMAC(secret, header || payload) | header | payload
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
from typing import Any

from checkpointless.errors import CheckpointlessError

__all__ = [
    "MAX_HEADER",
    "FrameError",
    "recv_frame",
    "send_frame",
]

_PREFIX = struct.Struct(">IQ")
_MAC_LEN = 32
MAX_HEADER = 1 << 20  # a header is a small JSON object; anything larger is an attack or a bug


class FrameError(CheckpointlessError):
    """A frame was malformed, failed authentication, or the peer went away mid-frame."""


def _seal(secret: bytes, header: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    mac = hmac.new(secret, header, hashlib.sha256)
    if payload:
        mac.update(payload)
    return mac.digest()


def send_frame(
    sock: socket.socket,
    secret: bytes,
    header: dict[str, Any],
    payload: bytes | bytearray | memoryview = b"",
) -> None:
    """Send one sealed frame. The socket's own timeout bounds the call."""
    hdr = json.dumps(header, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(len(hdr), len(payload)) + _seal(secret, hdr, payload)
    if len(payload) < 65536:
        sock.sendall(prefix + hdr + bytes(payload))
    else:  # avoid copying a large payload just to prepend a few bytes
        sock.sendall(prefix + hdr)
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out receiving a frame ({got}/{n} bytes)")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise FrameError("peer closed the connection" + (" mid-frame" if got else ""))
        got += k
    return buf


def recv_frame(
    sock: socket.socket,
    secret: bytes,
    deadline: float | None = None,
    max_payload: int = 1 << 40,
) -> tuple[dict[str, Any], bytearray]:
    """Receive one frame; raise :class:`FrameError` unless it carries a valid seal.

    ``deadline`` is a :func:`time.monotonic` instant; ``None`` waits as long as the socket's
    timeout allows (blocking sockets wait for ever, which only background readers use).
    """
    head = _recv_exact(sock, _PREFIX.size + _MAC_LEN, deadline)
    hlen, plen = _PREFIX.unpack_from(head)
    if hlen > MAX_HEADER or plen > max_payload:
        raise FrameError(f"frame too large (header {hlen} bytes, payload {plen} bytes)")
    mac = bytes(head[_PREFIX.size :])
    hdr = _recv_exact(sock, hlen, deadline)
    payload = _recv_exact(sock, plen, deadline) if plen else bytearray()
    if not hmac.compare_digest(mac, _seal(secret, bytes(hdr), payload)):
        raise FrameError("frame failed authentication (wrong job secret?)")
    try:
        header = json.loads(hdr)
    except ValueError as e:  # sealed but unparsable: a bug on the sender's side
        raise FrameError(f"authenticated frame has a malformed header: {e}") from e
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header, payload
