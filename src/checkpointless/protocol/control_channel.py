"""The control channel's handshake and framing, as both of its ends speak it.

One TCP connection per worker process (or host agent) to the coordinator, on loopback or the
job's own interface. Messages are small JSON objects with a ``type``, sealed
(:mod:`checkpointless.wire`) with keys derived from the per-job secret, one per direction
(:data:`C2S_LABEL`, :data:`S2C_LABEL`).

Replay protection, both ways: the client speaks first, an opening of :data:`OPENING_SIZE` bytes
(the protocol's magic and version, then a fresh random nonce of its own). Only then does the
server answer, with a sealed greeting that carries that nonce and a fresh nonce of the server's.
Every later client frame carries the server's nonce and every server frame the client's, each
with a strictly increasing sequence number inside the sealed header (:data:`NONCE_FIELD`,
:data:`SEQ_FIELD`). A frame recorded on another connection, or in the other direction, is
therefore refused, the greeting included: a recorded greeting answers another challenge, so an
endpoint without the secret that replays one is caught before the client says anything
(:class:`ReplayedGreeting`), and a greeting whose seal fails is a wrong secret
(:class:`WrongSecret`). A refused frame closes the connection without any sealed answer.

The client's end is :mod:`checkpointless.protocol.control_client` (a worker, an agent); the
server's, which only the coordinator runs, is ``launcher/control.py``. This module holds what they
must agree on, and nothing that runs.
"""

from __future__ import annotations

import secrets

__all__ = [
    "C2S_LABEL",
    "CLIENT_NONCE_FIELD",
    "GREETING_TYPE",
    "MAX_CONTROL_HEADER",
    "MAX_CONTROL_PAYLOAD",
    "NONCE_FIELD",
    "OPENING_SIZE",
    "OPEN_MAGIC",
    "S2C_LABEL",
    "SEND_TIMEOUT_S",
    "SEQ_FIELD",
    "ReplayedGreeting",
    "WrongSecret",
    "opening",
]

MAX_CONTROL_HEADER = 64 << 10  # the largest control message (a recovery plan) is a few KiB
MAX_CONTROL_PAYLOAD = 1 << 20  # control messages carry no payload today; leave room, cap it
SEND_TIMEOUT_S = 5.0  # a peer that takes no frame for this long is gone (both ends)
C2S_LABEL, S2C_LABEL = "control/c2s", "control/s2c"  # the key derivation's label per direction
# protocol fields inside the sealed header; stripped before a message reaches its consumer
NONCE_FIELD, SEQ_FIELD = "_n", "_q"
CLIENT_NONCE_FIELD = "_c"  # version 2's first frame; ignored now
GREETING_TYPE = "_greeting"  # the server's first frame
# The client's opening: the control protocol's magic and version (3: the client speaks first and
# the greeting answers its nonce), then its nonce. Fixed-size raw bytes, so the server answers it
# without parsing anything a peer chose.
OPEN_MAGIC = b"cl-ctl\x00\x03"
_OPEN_NONCE_BYTES = 16
OPENING_SIZE = len(OPEN_MAGIC) + _OPEN_NONCE_BYTES


class WrongSecret(ConnectionError):
    """The endpoint's greeting failed its seal: it does not hold the secret this process was
    given (a wrong --secret-file, or another job's coordinator on a stale address)."""


class ReplayedGreeting(ConnectionError):
    """The endpoint's greeting was sealed with the job's secret but answers another connection's
    nonce: a recording replayed by an endpoint that does not hold the secret (or a peer of an
    older protocol version, whose greeting answers nothing)."""


def opening() -> tuple[bytes, str]:
    """A client's opening bytes and the nonce in them (hex, as the greeting must carry it)."""
    nonce = secrets.token_bytes(_OPEN_NONCE_BYTES)
    return OPEN_MAGIC + nonce, nonce.hex()
