from __future__ import annotations

import socket

import pytest

from checkpointless.wire import FrameError, recv_frame, send_frame

pytestmark = pytest.mark.timeout(10)


def test_frames_round_trip_and_wrong_secret_is_rejected() -> None:
    a, b = socket.socketpair()
    send_frame(a, b"s3cret", {"type": "hello", "n": 1}, b"payload")
    hdr, payload = recv_frame(b, b"s3cret")
    assert hdr == {"type": "hello", "n": 1} and bytes(payload) == b"payload"
    send_frame(a, b"wrong", {"type": "abort"})
    with pytest.raises(FrameError, match="authentication"):
        recv_frame(b, b"s3cret")


def test_oversized_header_is_refused_before_reading_it() -> None:
    a, b = socket.socketpair()
    a.sendall((1 << 30).to_bytes(4, "big") + (0).to_bytes(8, "big") + b"\0" * 32)
    with pytest.raises(FrameError, match="too large"):
        recv_frame(b, b"k")
