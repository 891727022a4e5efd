"""The width rules (coordinator/rules/width.py): assign, wait, shrink or fail when spares run out;
which survivor holds a lost slot; which slots go back to ready spares."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.coordinator.rules.decisions import SpareAction, spare_policy
from checkpointless.coordinator.rules.width import (
    NoSparePolicy,
    WidthAction,
    WidthSituation,
    assign_slots,
    ideal_step_time,
    slots_to_grow,
    width_decision,
)

pytestmark = pytest.mark.timeout(60)


def _situation(**kw: object) -> WidthSituation:
    base: dict[str, object] = {
        "width": 4,
        "survivors": 3,
        "needed": 1,
        "ready": 0,
        "starting": 0,
        "waited": 0.0,
        "wait_limit": 60.0,
        "policy": NoSparePolicy.SHRINK,
        "min_replicas": 1,
    }
    return WidthSituation(**(base | kw))  # type: ignore[arg-type]


def test_a_ready_spare_is_always_used() -> None:
    for policy in NoSparePolicy:
        d = width_decision(_situation(ready=1, policy=policy))
        assert d.action == WidthAction.ASSIGN and d.spawn == 0 and d.width_after == 4


def test_shrink_goes_on_at_once_and_starts_the_spare_that_grows_it_back() -> None:
    d = width_decision(_situation())
    assert d.action == WidthAction.SHRINK and d.spawn == 1 and d.width_after == 3
    assert "3 of 4 replicas" in d.reason and "--when-no-spare shrink" in d.reason


def test_shrink_counts_the_spares_already_starting() -> None:
    d = width_decision(_situation(needed=2, survivors=2, starting=1))
    assert d.action == WidthAction.SHRINK and d.spawn == 1 and d.width_after == 2


def test_shrink_assigns_the_ready_spares_and_holds_the_rest() -> None:
    d = width_decision(_situation(needed=2, survivors=2, ready=1))
    assert d.action == WidthAction.SHRINK and d.width_after == 3 and d.spawn == 1


def test_wait_waits_then_shrinks() -> None:
    d = width_decision(_situation(policy=NoSparePolicy.WAIT, waited=10.0))
    assert d.action == WidthAction.WAIT and d.spawn == 1
    d = width_decision(_situation(policy=NoSparePolicy.WAIT, waited=60.0))
    assert d.action == WidthAction.SHRINK and "--when-no-spare wait" in d.reason


def test_fail_waits_then_fails_naming_the_settings() -> None:
    assert width_decision(_situation(policy=NoSparePolicy.FAIL, waited=59.9)).action == WidthAction.WAIT
    d = width_decision(_situation(policy=NoSparePolicy.FAIL, waited=60.0))
    assert d.action == WidthAction.FAIL and "--spares" in d.reason and "--spare-wait" in d.reason


def test_below_min_replicas_waits_then_fails_with_the_reason() -> None:
    # the done-when case: 4 ranks, rank 2 lost, --min-replicas 4
    d = width_decision(_situation(min_replicas=4))
    assert d.action == WidthAction.WAIT and d.spawn == 1
    d = width_decision(_situation(min_replicas=4, waited=61.0))
    assert d.action == WidthAction.FAIL
    assert "3 of 4 replicas, fewer than --min-replicas 4" in d.reason, d.reason


def test_a_job_that_cannot_shrink_fails_with_why() -> None:
    why = "a sharded device mesh (FSDP/HSDP) cannot yet drop a replica group"
    assert width_decision(_situation(not_shrinkable=why)).action == WidthAction.WAIT
    d = width_decision(_situation(not_shrinkable=why, waited=60.0))
    assert d.action == WidthAction.FAIL and why in d.reason


def test_every_process_lost_cannot_shrink() -> None:
    d = width_decision(_situation(survivors=0, needed=4, waited=60.0))
    assert d.action == WidthAction.FAIL


_counts = st.integers(min_value=0, max_value=16)


@settings(max_examples=300, deadline=None)
@given(
    ready=_counts,
    starting=_counts,
    needed=st.integers(min_value=1, max_value=16),
    waited=st.floats(min_value=0, max_value=200, allow_nan=False),
    wait_limit=st.floats(min_value=0.1, max_value=100, allow_nan=False),
)
def test_fail_policy_is_the_old_spare_policy(
    ready: int, starting: int, needed: int, waited: float, wait_limit: float
) -> None:
    old = spare_policy(ready, starting, needed, waited, wait_limit)
    new = width_decision(
        WidthSituation(
            16, 16 - min(needed, 16), needed, ready, starting, waited, wait_limit, NoSparePolicy.FAIL
        )
    )
    expected = {
        SpareAction.ASSIGN: WidthAction.ASSIGN,
        SpareAction.WAIT: WidthAction.WAIT,
        SpareAction.FAIL: WidthAction.FAIL,
    }
    assert new.action == expected[old.action]
    assert new.spawn == old.spawn and new.reason == old.reason


@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(min_value=1, max_value=32),
    data=st.data(),
    policy=st.sampled_from(list(NoSparePolicy)),
    waited=st.floats(min_value=0, max_value=200, allow_nan=False),
)
def test_never_shrinks_below_min_replicas_and_never_waits_past_the_limit(
    width: int, data: st.DataObject, policy: NoSparePolicy, waited: float
) -> None:
    needed = data.draw(st.integers(min_value=1, max_value=width))
    s = WidthSituation(
        width=width,
        survivors=width - needed,
        needed=needed,
        ready=data.draw(st.integers(min_value=0, max_value=needed)),
        starting=data.draw(st.integers(min_value=0, max_value=needed)),
        waited=waited,
        wait_limit=30.0,
        policy=policy,
        min_replicas=data.draw(st.integers(min_value=1, max_value=width)),
    )
    d = width_decision(s)
    assert d.spawn >= 0 and d.spawn <= needed
    if d.action == WidthAction.SHRINK:
        assert policy != NoSparePolicy.FAIL
        assert s.min_replicas <= d.width_after < width and d.width_after >= 1
    if d.action == WidthAction.WAIT:
        assert waited < 30.0, "waited past --spare-wait"
    if s.ready >= needed:
        assert d.action == WidthAction.ASSIGN
    if d.action == WidthAction.FAIL:
        assert d.reason


def test_assign_slots_spreads_the_load() -> None:
    held = assign_slots({0: [0], 1: [1], 3: [3]}, [2])
    assert held == {0: [0, 2], 1: [1], 3: [3]}
    assert assign_slots({0: [0, 2], 1: [1], 3: [3]}, []) == {0: [0, 2], 1: [1], 3: [3]}
    # two lost at once: each goes to one of the least loaded, the lowest process on a tie
    assert assign_slots({0: [0], 3: [3]}, [1, 2]) == {0: [0, 1], 3: [2, 3]}


def test_assign_slots_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="no live process"):
        assign_slots({}, [1])
    with pytest.raises(ValueError, match="both lost and held"):
        assign_slots({0: [0, 1]}, [1])


@settings(max_examples=300, deadline=None)
@given(width=st.integers(min_value=1, max_value=24), data=st.data())
def test_assign_slots_holds_every_slot_exactly_once_balanced(width: int, data: st.DataObject) -> None:
    live = data.draw(st.sets(st.integers(min_value=0, max_value=width - 1), min_size=1))
    lost = [s for s in range(width) if s not in live]
    held = assign_slots({p: [p] for p in live}, lost)
    assert set(held) == live
    slots = sorted(s for ss in held.values() for s in ss)
    assert slots == list(range(width))
    loads = [len(ss) for ss in held.values()]
    assert max(loads) - min(loads) <= 1
    assert all(p in held[p] for p in held)


@settings(max_examples=300, deadline=None)
@given(width=st.integers(min_value=1, max_value=24), data=st.data())
def test_growing_back_gives_every_extra_slot_to_a_spare_and_never_a_first_one(
    width: int, data: st.DataObject
) -> None:
    live = data.draw(st.sets(st.integers(min_value=0, max_value=width - 1), min_size=1))
    held = assign_slots({p: [p] for p in live}, [s for s in range(width) if s not in live])
    extra = width - len(live)
    ready = data.draw(st.integers(min_value=0, max_value=width + 2))
    back = slots_to_grow(held, ready)
    assert len(back) == min(ready, extra)
    assert not set(back) & live, "a process's own slot never goes back"
    if ready >= extra:
        assert sorted(back) == sorted(set(range(width)) - live)
    # what is left is still balanced as far as it can be
    left = {p: [s for s in ss if s not in back] for p, ss in held.items()}
    loads = [len(ss) for ss in left.values()]
    assert max(loads) - min(loads) <= 1


def test_grow_takes_from_the_most_loaded_first() -> None:
    assert slots_to_grow({0: [0, 1, 2], 3: [3, 4]}, 1) == [2]
    # then 0 and 3 hold two each: the lowest process gives up its extra slot
    assert slots_to_grow({0: [0, 1, 2], 3: [3, 4]}, 2) == [1, 2]
    assert slots_to_grow({0: [0], 1: [1]}, 3) == []


def test_ideal_step_time_is_set_by_the_most_loaded_process() -> None:
    assert ideal_step_time(0.1, 4, {0: [0, 2], 1: [1], 3: [3]}) == pytest.approx(0.2)
    assert ideal_step_time(0.1, 4, {p: [p] for p in range(4)}) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        ideal_step_time(0.1, 4, {})
