"""Typed messages: every message survives encode/decode, and nothing a peer can send makes decode
raise anything but ProtocolError."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.protocol import (
    Abort,
    Assign,
    Committed,
    Heartbeat,
    Hello,
    ProtocolError,
    Recover,
    ResumePlan,
    Stopped,
    decode,
    encode,
)

pytestmark = pytest.mark.timeout(60)

SAMPLES = [
    Hello(worker_id=3, pid=42, role="spare"),
    Heartbeat(step=None, progress_age=0.25, in_collective=True, step_time=None),
    Stopped(
        for_generation=2, committed_step=7, valid=False, cause="exception", error="x", step=7, snapshot_step=5
    ),
    Committed(generation=1, step=8, first_batch_s=0.001, state_bytes=1 << 20),
    Assign(rank=1, world_size=4, generation=3, faults=["kill:rank=1:step=4"], fired=[], snapshot_every=50),
    Abort(generation=4, reason="killed"),
    Recover(generation=4, rendezvous={"kind": "rootless", "peers": ["127.0.0.1:1"]}, plan=ResumePlan(7)),
    Recover(
        generation=5,
        rendezvous={"kind": "tcp"},
        plan=ResumePlan(
            9,
            0,
            receivers=[1, 3],
            sources=[[1, 3], [3, 1]],
            from_copy=[3],
            own_snapshot=[0],
            from_checkpoint=True,
        ),
    ),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=[type(m).__name__ for m in SAMPLES])
def test_round_trip_through_json(msg: object) -> None:
    wire = json.loads(json.dumps(encode(msg)))  # type: ignore[arg-type]
    assert decode(wire) == msg


def test_wrong_types_and_unknown_messages_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode({"type": "launch_missiles"})
    with pytest.raises(ProtocolError, match="worker_id"):
        decode({"type": "hello", "worker_id": "3"})
    with pytest.raises(ProtocolError, match="missing field 'committed_step'"):
        decode({"type": "stopped", "for_generation": 1, "valid": True})
    with pytest.raises(ProtocolError, match="valid"):
        decode({"type": "stopped", "for_generation": 1, "committed_step": 1, "valid": 1})
    with pytest.raises(ProtocolError, match="version"):
        decode({"type": "hello", "worker_id": 1, "v": 99})
    with pytest.raises(ProtocolError):
        decode(["hello"])
    # a newer sender's extra fields are ignored
    assert decode({"type": "hello", "worker_id": 1, "shiny": True}) == Hello(worker_id=1)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
names = st.sampled_from(
    ["hello", "heartbeat", "stopped", "recovered", "committed", "assign", "recover", "abort", "fired", "x"]
)
fields = st.sampled_from([f.name for m in SAMPLES for f in dataclasses.fields(m)] + ["type", "v", "junk"])


@settings(max_examples=200, deadline=1000)
@given(kind=names, body=st.dictionaries(fields, json_values, max_size=8))
def test_decode_of_anything_is_a_message_or_a_protocol_error(kind: str, body: dict[str, object]) -> None:
    body = {**body, "type": kind} if "type" not in body else body
    try:
        decode(body)
    except ProtocolError:
        pass


def test_a_recover_plan_travels_compact_typed_and_checked() -> None:
    # every rank a receiver, each from its own shard's holder: a few bytes whatever the job's size
    n = 80_000
    plan = ResumePlan(0, 0, receivers=list(range(1, n)), sources=[[r, r % 4] for r in range(4, n)])
    wire = json.loads(json.dumps(encode(Recover(generation=1, rendezvous={}, plan=plan))))
    assert len(json.dumps(wire["plan"])) < 200 and "receivers" not in wire["plan"]
    got = decode(wire)
    assert isinstance(got, Recover) and got.plan == plan
    assert got.plan.source_of()[n - 1] == (n - 1) % 4
    # unset optional fields stay off the wire, as before the plan was typed
    assert encode(Recover(generation=1, rendezvous={}, plan=ResumePlan(3)))["plan"] == {
        "target_step": 3,
        "source": -1,
        "receivers": [],
    }
    bad: list[dict[str, object]] = [
        {"target_step": "3"},
        {"source": 0},
        {"target_step": 1, "receiver_ranges": [[0, 1 << 40]]},
        {"target_step": 1, "receiver_ranges": [[5, 2]]},
        {"target_step": 1, "receiver_ranges": "0-9"},
        {"target_step": 1, "source_runs": [[0, 1, 0, 0]]},
        {"target_step": 1, "sources": [[1]]},
    ]
    for p in bad:
        with pytest.raises(ProtocolError):
            decode({"type": "recover", "generation": 1, "rendezvous": {}, "plan": p})
