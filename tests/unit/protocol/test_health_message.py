"""The health report on the agent's link (protocol 5): it survives encode/decode, and nothing a
peer can send as one makes decode raise anything but ProtocolError."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.protocol import VERSION, AgentHello, HealthReport, ProtocolError, decode, encode

pytestmark = pytest.mark.timeout(60)

SAMPLES = [
    HealthReport(ok=True),
    HealthReport(
        ok=False,
        age=1.5,
        names=["memory", "command:/opt/check.sh"],
        passed=[True, False],
        details=["64 MiB allocated and written", "exit 1: GPU 3 missing"],
        seconds=[0.12, 0.4],
    ),
    AgentHello(host="10.0.0.2", health=True),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=[type(m).__name__ for m in SAMPLES])
def test_round_trip_through_json(msg: object) -> None:
    wire = json.loads(json.dumps(encode(msg)))  # type: ignore[arg-type]
    assert wire["v"] == VERSION
    assert decode(wire) == msg


def test_wrong_types_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="ok"):
        decode({"type": "host_health", "ok": "yes"})
    with pytest.raises(ProtocolError, match="passed"):
        decode({"type": "host_health", "ok": True, "passed": [1]})
    with pytest.raises(ProtocolError, match="missing field 'ok'"):
        decode({"type": "host_health"})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["ok", "age", "names", "passed", "details", "seconds", "health", "v", "junk"])


@settings(max_examples=200, deadline=1000)
@given(
    kind=st.sampled_from(["host_health", "agent_hello"]),
    body=st.dictionaries(fields, json_values, max_size=8),
)
def test_decode_of_anything_is_a_message_or_a_protocol_error(kind: str, body: dict[str, object]) -> None:
    try:
        decode({**body, "type": kind})
    except ProtocolError:
        pass
