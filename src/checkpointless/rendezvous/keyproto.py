"""What a key server and its readers agree on: version, seal labels, mutating ops, value packing.

Both ends of a key-server connection need these: the server
(:mod:`~checkpointless.rendezvous.server`, and its request handling in
:mod:`~checkpointless.rendezvous.server_requests`), the client
(:mod:`~checkpointless.rendezvous.client`), the store that packs values
(:mod:`~checkpointless.rendezvous.store`) and the bulk transfers that borrow a key server's port
(:mod:`checkpointless.state.stream`). They live apart from the server so that a reader imports the
contract without importing the server that implements it.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "KEYSERVER_C2S",
    "KEYSERVER_S2C",
    "MAX_WAIT_S",
    "MUTATING_OPS",
    "PROTOCOL_VERSION",
    "clamp_wait",
    "join_values",
    "split_values",
]

PROTOCOL_VERSION = 2  # 2: per-direction keys, no sealed "auth" reply
KEYSERVER_C2S = "keyserver/c2s"  # key labels (wire.derive_key): requests, and stream acks
KEYSERVER_S2C = "keyserver/s2c"  # replies, and a stream's manifest and trailer
# these need the connection's nonce ("stream" too: a replayed one must not get a connection)
MUTATING_OPS = frozenset({"set", "add", "cas", "append", "del", "stream"})

# The longest wait a key server or store takes on: 2**31 - 1 ms (24.8 days), the bound of an
# epoll/poll timeout, and the same cut our process groups make (comm/work.py MAX_TIMEOUT). Torch
# hands the store its process group's timeout, and Lightning's is 10000 days: passed on unclamped
# it made ``select`` raise ``OverflowError: timeout is too large`` in the key server's loop.
MAX_WAIT_S = (2**31 - 1) / 1000


def clamp_wait(seconds: float) -> float:
    """A wait's length in seconds cut to ``0..MAX_WAIT_S`` (infinity: the longest; NaN raises
    ValueError: no deadline can be made of it)."""
    if math.isnan(seconds):
        raise ValueError("a wait's timeout is not a number")
    return min(max(0.0, seconds), MAX_WAIT_S)


def join_values(values: list[bytes]) -> tuple[list[int], bytes]:
    """Pack values into one payload plus their lengths (the header carries the lengths)."""
    return [len(v) for v in values], b"".join(values)


def split_values(lens: Any, payload: bytes | bytearray, count: int) -> list[bytes] | None:
    """Inverse of :func:`join_values`; None when the lengths do not describe the payload."""
    if (
        not isinstance(lens, list)
        or len(lens) != count
        or not all(isinstance(n, int) and n >= 0 for n in lens)
        or sum(lens) != len(payload)
    ):
        return None
    out: list[bytes] = []
    pos = 0
    for n in lens:
        out.append(bytes(payload[pos : pos + n]))
        pos += n
    return out
