"""Property-based fuzzing of what the sockets parse: frames, the control sequence check, manifests.

Each property has a fixed budget so the whole file runs in seconds inside ``make test``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointless.errors import StateTransferError
from checkpointless.launcher.control import Connection
from checkpointless.state.codec import layout, receive_buffers, unpack
from checkpointless.state.manifest import parse_manifest
from checkpointless.wire import PREFIX_SIZE, FrameDecoder, FrameError, encode_frame

pytestmark = pytest.mark.timeout(120)

KEY = b"k" * 32
MAX_HEADER, MAX_PAYLOAD = 4096, 8192
BUDGET = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

headers = st.dictionaries(
    st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=20), st.booleans(), st.none()), max_size=5
)


def _feed_in_pieces(
    dec: FrameDecoder, data: bytes, cuts: list[int]
) -> list[tuple[dict[str, Any], bytearray]]:
    out: list[tuple[dict[str, Any], bytearray]] = []
    pos = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        if cut > pos:
            out += dec.feed(data[pos:cut])
            # what it holds never exceeds one capped frame, whatever the prefix announced
            assert len(dec._body) <= MAX_HEADER + MAX_PAYLOAD
            pos = cut
    return out


@BUDGET
@given(st.lists(st.tuples(headers, st.binary(max_size=300)), max_size=4), st.lists(st.integers(0, 10_000)))
def test_frames_survive_any_split(frames: list[tuple[dict[str, Any], bytes]], cuts: list[int]) -> None:
    data = b"".join(encode_frame(KEY, h, p) for h, p in frames)
    dec = FrameDecoder(KEY, max_header=MAX_HEADER, max_payload=MAX_PAYLOAD)
    got = _feed_in_pieces(dec, data, cuts)
    assert [(h, bytes(p)) for h, p in got] == frames
    assert not dec.partial and dec.want() == PREFIX_SIZE


@BUDGET
@given(st.binary(max_size=2000), st.lists(st.integers(0, 3000), max_size=6))
def test_random_bytes_never_pass_and_never_allocate(data: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(KEY, max_header=MAX_HEADER, max_payload=MAX_PAYLOAD)
    try:
        got = _feed_in_pieces(dec, data, cuts)
    except FrameError:
        return
    assert got == []  # without the key nothing authenticates


@BUDGET
@given(st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 64) - 1))
def test_any_prefix_is_refused_or_bounded(hlen: int, plen: int) -> None:
    dec = FrameDecoder(KEY, max_header=MAX_HEADER, max_payload=MAX_PAYLOAD)
    prefix = struct.pack(">IQ", hlen, plen) + b"\0" * 32
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        with pytest.raises(FrameError, match="too large"):
            dec.feed(prefix)
    elif hlen + plen == 0:  # complete at once: a zero MAC over nothing does not authenticate
        with pytest.raises(FrameError, match="authentication"):
            dec.feed(prefix)
    else:
        assert dec.feed(prefix) == []
        assert dec.want() == hlen + plen  # waits for the body, reserving nothing for it


@BUDGET
@given(headers, st.binary(max_size=200), st.data())
def test_a_flipped_bit_is_never_accepted(header: dict[str, Any], payload: bytes, data: st.DataObject) -> None:
    frame = bytearray(encode_frame(KEY, header, payload))
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    dec = FrameDecoder(KEY, max_header=MAX_HEADER, max_payload=MAX_PAYLOAD)
    try:
        got = dec.feed(bytes(frame))
    except FrameError:
        return
    assert got == []  # a flipped length only leaves it waiting for bytes that never come


@BUDGET
@given(st.lists(st.integers(-3, 12), min_size=1, max_size=12))
def test_control_frames_are_accepted_only_in_strictly_increasing_sequence(seqs: list[int]) -> None:
    conn = Connection.__new__(Connection)  # only the sequence logic, no socket
    conn.nonce, conn.peer_nonce, conn.last_in, conn.authenticated = "N", "", 0, False
    highest = 0
    for seq in seqs:
        frame = {"type": "x", "_n": "N", "_q": seq, "_c": "C"}
        if seq > highest:
            assert conn.accept_frame(frame) == {"type": "x"}
            highest = seq
        else:
            with pytest.raises(FrameError):
                conn.accept_frame(frame)
            return  # the server closes the connection after the first refusal
    with pytest.raises(FrameError):  # another connection's nonce
        conn.accept_frame({"type": "x", "_n": "other", "_q": highest + 1})


# -- state manifests ---------------------------------------------------------------------------
_STATE = {
    "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "step": 3,
    "opt": ({"m": torch.ones(2)}, [1.5]),
}
_GOOD = layout(_STATE, solo_min=16).manifest

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 70), 1 << 70),
        st.floats(allow_nan=False),
        st.text(max_size=6),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _decode_all(mbytes: bytes) -> None:
    """What a receiver does with a manifest; only StateTransferError may come out."""
    manifest = parse_manifest(mbytes, max_bytes=1 << 20)
    buffers, _ = receive_buffers(manifest)
    unpack(manifest, buffers)


def _mutate(manifest: Any, path: list[Any], value: Any) -> Any:
    node = manifest
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return manifest


def _paths(v: Any, prefix: tuple[Any, ...] = ()) -> list[list[Any]]:
    out: list[list[Any]] = []
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        out.append([*prefix, k])
        out += _paths(x, (*prefix, k))
    return out


_GOOD_PATHS = _paths(_GOOD)


@BUDGET
@given(st.sampled_from(_GOOD_PATHS), json_values)
def test_a_mutated_manifest_fails_only_as_a_state_transfer_error(path: list[Any], value: Any) -> None:
    bad = _mutate(json.loads(json.dumps(_GOOD)), path, value)
    try:
        _decode_all(json.dumps(bad).encode())
    except StateTransferError:
        pass


@BUDGET
@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=200)))
def test_arbitrary_manifests_fail_only_as_a_state_transfer_error(mbytes: bytes) -> None:
    try:
        _decode_all(mbytes)
    except StateTransferError:
        pass


def test_deep_or_huge_manifests_are_refused_before_allocating() -> None:
    with pytest.raises(StateTransferError):
        _decode_all(b"[" * 100_000 + b"]" * 100_000)
    deep: Any = 0
    for _ in range(200):
        deep = [deep]
    with pytest.raises(StateTransferError, match="deeper"):
        _decode_all(json.dumps({**_GOOD, "tree": deep}).encode())
    with pytest.raises(StateTransferError, match="announces"):
        _decode_all(json.dumps({**_GOOD, "messages": [1 << 50]}).encode())
    # the good one still decodes to the same state
    tree = unpack(_GOOD, receive_buffers(parse_manifest(json.dumps(_GOOD).encode()))[0])
    assert tree["step"] == 3 and tree["w"].shape == (2, 3)
