"""Authenticated framing for every socket that checkpointless opens.

A frame is a JSON header plus an optional binary payload, sealed with an HMAC-SHA256. The receiver
checks the seal *before* it parses anything, so a process that does not know the key can neither
inject messages nor make us decode its bytes. Nothing is ever unpickled from a socket.

Layout (big-endian)::

    u32 header_len | u64 payload_len | 32-byte HMAC(key, header || payload) | header | payload

Keys: nothing is sealed with the job secret itself. :func:`derive_key` turns it into one key per
channel and direction (``control/c2s``, ``keyserver/s2c``, ...), so a frame recorded on one
channel or in one direction fails the seal anywhere else (no reflection, no cross-channel replay).

Confidential values: frames are authenticated, not encrypted. The few values that must stay
secret from whoever can read the network (today the job's shared-memory key in an agent's welcome)
travel as :func:`seal_value` tokens instead: ChaCha20-Poly1305 under a key derived from the job
secret (HKDF-SHA256) per label, so a relay in the middle of a connection reads nothing of them.

Sizes: the length prefix is checked against the receiver's caps *before* a byte of the body is
read or allocated, and the body is assembled from what actually arrives (never pre-allocated from
the announced size), so an unauthenticated peer cannot make us reserve memory by lying about it.
:class:`FrameDecoder` does the same incrementally for the event-loop servers, which must never
block on one slow client.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import socket
import struct
import time
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from checkpointless.errors import CheckpointlessError

__all__ = [
    "MAX_HEADER",
    "PREFIX_SIZE",
    "FrameAuthError",
    "FrameDecoder",
    "FrameError",
    "FrameTooLarge",
    "derive_key",
    "encode_frame",
    "open_value",
    "parse_header",
    "recv_frame",
    "seal_value",
    "send_frame",
]

_PREFIX = struct.Struct(">IQ")
_MAC_LEN = 32
PREFIX_SIZE = _PREFIX.size + _MAC_LEN
MAX_HEADER = 1 << 20  # a header is a small JSON object; anything larger is an attack or a bug
_DEFAULT_MAX_PAYLOAD = 64 << 20  # callers moving more (state manifests) say so explicitly
_RECV_CHUNK = 1 << 18  # bounds what one recv may allocate on top of what has arrived
_KDF_CONTEXT = b"checkpointless/wire/v2/"
_AEAD_CONTEXT = b"checkpointless/aead/v1/"
_AEAD_NONCE = 12
_MAX_TOKEN = 4096  # a sealed value is a key or an address, never more


class FrameError(CheckpointlessError):
    """A frame was malformed, failed authentication, or the peer went away mid-frame."""


class FrameTooLarge(FrameError):
    """A length prefix announced more than the receiver accepts; nothing of it was read."""


class FrameAuthError(FrameError):
    """A whole frame arrived and its seal is wrong: the peer does not hold this job's secret
    (or the bytes were changed on the way)."""


def derive_key(secret: bytes, label: str) -> bytes:
    """The key for one channel and direction, e.g. ``derive_key(secret, "control/c2s")``.

    HMAC-SHA256 keyed by the secret over a fixed context plus the label (the usual
    HKDF-expand step for a single 32-byte output), so keys for different labels are independent.
    """
    if not secret:
        raise ValueError("derive_key needs a non-empty secret")
    return hmac.new(secret, _KDF_CONTEXT + label.encode(), hashlib.sha256).digest()


def _aead(secret: bytes, label: str) -> ChaCha20Poly1305:
    if not secret:
        raise ValueError("seal_value needs a non-empty secret")
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_AEAD_CONTEXT + label.encode())
    return ChaCha20Poly1305(hkdf.derive(secret))


def seal_value(secret: bytes, label: str, value: bytes) -> str:
    """``value`` encrypted and authenticated for a frame's header: a random 96-bit nonce plus
    ChaCha20-Poly1305 under the key HKDF derives from the job secret for ``label`` (which is also
    the associated data), as unpadded URL-safe base64. Only a holder of the secret reads it."""
    nonce = os.urandom(_AEAD_NONCE)
    sealed = nonce + _aead(secret, label).encrypt(nonce, value, label.encode())
    return base64.urlsafe_b64encode(sealed).rstrip(b"=").decode("ascii")


def open_value(secret: bytes, label: str, token: str) -> bytes:
    """The value :func:`seal_value` sealed under ``label``; :class:`FrameAuthError` if the token
    is malformed, was sealed under another secret or label, or was changed."""
    if not isinstance(token, str) or len(token) > _MAX_TOKEN:
        raise FrameAuthError(f"sealed {label} is not a token of at most {_MAX_TOKEN} characters")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (ValueError, binascii.Error) as e:
        raise FrameAuthError(f"sealed {label} is not base64: {e}") from None
    if len(raw) < _AEAD_NONCE + 16:
        raise FrameAuthError(f"sealed {label} is too short ({len(raw)} bytes)")
    try:
        return _aead(secret, label).decrypt(raw[:_AEAD_NONCE], raw[_AEAD_NONCE:], label.encode())
    except InvalidTag:
        raise FrameAuthError(f"sealed {label} failed authentication (wrong job secret?)") from None


def _seal(
    key: bytes, header: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview
) -> bytes:
    mac = hmac.new(key, header, hashlib.sha256)
    if payload:
        mac.update(payload)
    return mac.digest()


def _encode_head(key: bytes, header: dict[str, Any], payload: bytes | bytearray | memoryview) -> bytes:
    hdr = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(len(hdr), len(payload)) + _seal(key, hdr, payload) + hdr


def encode_frame(key: bytes, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One sealed frame as bytes, for callers that write it themselves (non-blocking sockets)."""
    return _encode_head(key, header, payload) + bytes(payload)


def send_frame(
    sock: socket.socket,
    key: bytes,
    header: dict[str, Any],
    payload: bytes | bytearray | memoryview = b"",
) -> None:
    """Send one sealed frame. The socket's own timeout bounds the call."""
    head = _encode_head(key, header, payload)
    if len(payload) < 65536:
        sock.sendall(head + bytes(payload))
    else:  # avoid copying a large payload just to prepend a few bytes
        sock.sendall(head)
        sock.sendall(payload)


def parse_header(hdr: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode an *authenticated* header; a malformed one is the sender's bug."""
    try:
        header = json.loads(bytes(hdr))
    except ValueError as e:
        raise FrameError(f"authenticated frame has a malformed header: {e}") from e
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header


def _check_sizes(hlen: int, plen: int, max_header: int, max_payload: int) -> None:
    if hlen > max_header or plen > max_payload:
        raise FrameTooLarge(
            f"frame too large (header {hlen} bytes, payload {plen} bytes; "
            f"this socket accepts at most {max_header} / {max_payload})"
        )


class FrameDecoder:
    """Assembles frames from bytes as they arrive, for non-blocking sockets.

    :meth:`want` says how many more bytes complete the current frame, so a caller that reads at
    most that much never consumes bytes past a frame boundary (the key server hands a connection
    over to a bulk transfer right after one frame). :meth:`feed` returns each complete, verified
    frame; it raises :class:`FrameTooLarge` as soon as a prefix exceeds the caps and
    :class:`FrameError` on a bad seal, after which the connection must be closed.
    """

    __slots__ = ("_body", "_hlen", "_key", "_mac", "_max_header", "_max_payload", "_need", "_prefix")

    def __init__(
        self, key: bytes, *, max_header: int = MAX_HEADER, max_payload: int = _DEFAULT_MAX_PAYLOAD
    ) -> None:
        self._key = key
        self._max_header = max_header
        self._max_payload = max_payload
        self._prefix = bytearray()
        self._body = bytearray()
        self._hlen = 0
        self._mac = b""
        self._need = 0  # body bytes still missing; 0 while the prefix is being read

    def want(self) -> int:
        """Bytes that would complete the frame in progress (or the next frame's prefix)."""
        if self._need:
            return self._need
        return PREFIX_SIZE - len(self._prefix)

    @property
    def partial(self) -> bool:
        """True while a frame has started arriving but is not complete."""
        return bool(self._prefix) or bool(self._need)

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[dict[str, Any], bytearray]]:
        frames: list[tuple[dict[str, Any], bytearray]] = []
        view = memoryview(data)
        while view.nbytes:
            if not self._need:
                take = PREFIX_SIZE - len(self._prefix)
                self._prefix += view[:take]
                view = view[take:]
                if len(self._prefix) < PREFIX_SIZE:
                    break
                hlen, plen = _PREFIX.unpack_from(self._prefix)
                _check_sizes(hlen, plen, self._max_header, self._max_payload)
                self._hlen, self._mac = hlen, bytes(self._prefix[_PREFIX.size :])
                self._need = hlen + plen
                self._prefix.clear()
                if self._need == 0:  # an empty header cannot be a JSON object; let the seal decide
                    frames.append(self._finish())
                continue
            take = min(self._need, view.nbytes)
            self._body += view[:take]
            view = view[take:]
            self._need -= take
            if not self._need:
                frames.append(self._finish())
        return frames

    def _finish(self) -> tuple[dict[str, Any], bytearray]:
        body, self._body = self._body, bytearray()
        hdr, payload = memoryview(body)[: self._hlen], body[self._hlen :]
        if not hmac.compare_digest(self._mac, _seal(self._key, hdr, payload)):
            raise FrameAuthError("frame failed authentication (wrong job secret?)")
        header = parse_header(hdr)
        hdr.release()
        return header, payload


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    # grows with what arrives instead of allocating n up front: n comes from an unverified prefix
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out receiving a frame ({len(buf)}/{n} bytes)")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), _RECV_CHUNK))
        if not chunk:
            raise FrameError("peer closed the connection" + (" mid-frame" if buf else ""))
        buf += chunk
    return buf


def recv_frame(
    sock: socket.socket,
    key: bytes,
    deadline: float | None = None,
    max_payload: int = _DEFAULT_MAX_PAYLOAD,
    max_header: int = MAX_HEADER,
) -> tuple[dict[str, Any], bytearray]:
    """Receive one frame (blocking); raise :class:`FrameError` unless it carries a valid seal.

    ``deadline`` is a :func:`time.monotonic` instant; ``None`` waits as long as the socket's
    timeout allows (blocking sockets wait for ever, which only background readers use).
    """
    head = _recv_exact(sock, PREFIX_SIZE, deadline)
    hlen, plen = _PREFIX.unpack_from(head)
    _check_sizes(hlen, plen, max_header, max_payload)
    body = _recv_exact(sock, hlen + plen, deadline) if hlen + plen else bytearray()
    hdr, payload = memoryview(body)[:hlen], body[hlen:]
    if not hmac.compare_digest(bytes(head[_PREFIX.size :]), _seal(key, hdr, payload)):
        raise FrameAuthError("frame failed authentication (wrong job secret?)")
    header = parse_header(hdr)
    hdr.release()
    return header, payload
