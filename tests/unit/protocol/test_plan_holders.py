"""ResumePlan.holders (protocol 7, degraded mode): which live process holds which lost slot travels
typed and checked; a plan at full width sends nothing new; any mutation of the field decodes or
fails as a ProtocolError, never anything else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.protocol import VERSION, ProtocolError, Recover, ResumePlan, decode, encode

pytestmark = pytest.mark.timeout(60)


def _roundtrip(plan: ResumePlan) -> ResumePlan:
    got = decode(json.loads(json.dumps(encode(Recover(generation=3, rendezvous={}, plan=plan)))))
    assert isinstance(got, Recover)
    return got.plan


def test_version_7() -> None:
    assert VERSION == 7


def test_holders_travel_and_say_each_process_its_slots() -> None:
    plan = ResumePlan(12, 0, receivers=[], holders=[[2, 1], [5, 3]])
    back = _roundtrip(plan)
    assert back == plan
    assert back.held_by() == {2: 1, 5: 3}
    assert back.slots_of(1) == [1, 2] and back.slots_of(3) == [3, 5] and back.slots_of(0) == [0]


def test_full_width_plan_is_unchanged_on_the_wire() -> None:
    wire = encode(Recover(generation=1, rendezvous={}, plan=ResumePlan(3)))["plan"]
    assert "holders" not in wire


@pytest.mark.parametrize(
    "holders",
    [
        [[2]],  # not a pair
        [[2, 2]],  # a slot holding itself
        [[2, 1], [2, 3]],  # one slot held twice
        [[2, 1], [1, 0]],  # a lost slot's process cannot hold anything
        [[-1, 0]],
        [[2, "1"]],
        "2:1",
    ],
)
def test_bad_holders_are_refused(holders: Any) -> None:
    plan = {"target_step": 1, "source": 0, "receivers": [], "holders": holders}
    with pytest.raises(ProtocolError):
        decode({"type": "recover", "generation": 1, "rendezvous": {}, "plan": plan})


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(holders=_values)
def test_any_holders_field_decodes_or_is_a_protocol_error(holders: Any) -> None:
    plan = {"target_step": 1, "source": 0, "receivers": [], "holders": holders}
    try:
        got = decode({"type": "recover", "generation": 1, "rendezvous": {}, "plan": plan})
    except ProtocolError:
        return
    assert isinstance(got, Recover)
    held = got.plan.held_by()
    assert len(held) == len(got.plan.holders)
    assert not set(held) & set(held.values())
