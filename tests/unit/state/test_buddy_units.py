"""Buddy copies as pure logic: ring placement, and recovery plans that use kept copies and
per-rank snapshots (replica -> buddy copy -> own snapshot -> error), never a missing shard."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpointless.coordinator.rules.decisions import MemberReport, plan_recovery
from checkpointless.errors import ConfigError, NotRecoverableError
from checkpointless.recovery.sharded import buddies_wanted
from checkpointless.state.buddy_owner import copy_due
from checkpointless.state.buddy_ring import buddy_of, host_of, owners_of

pytestmark = pytest.mark.timeout(30)


# -- placement -------------------------------------------------------------------------------------
def test_ring_one_host_over() -> None:
    # 2 hosts x 2 ranks: every copy lies on the other host
    assert [buddy_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    # 3 hosts x 2 ranks: host 0 -> 1 -> 2 -> 0
    assert [buddy_of(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]


def test_one_host_uses_the_next_rank_and_a_world_of_one_has_none() -> None:
    assert [buddy_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]
    assert [buddy_of(r, 4, -1) for r in range(4)] == [1, 2, 3, 0]  # "one machine" from the launcher
    assert buddy_of(0, 1, 1) is None
    assert owners_of(1, 4, 4) == [0]


@given(st.integers(1, 8), st.integers(1, 8), st.data())
def test_never_the_same_host_when_there_are_two(per_host: int, hosts: int, data: st.DataObject) -> None:
    # host-major placement, the last host possibly part-filled
    world = data.draw(st.integers(max(1, (hosts - 1) * per_host + 1), hosts * per_host))
    for r in range(world):
        b = buddy_of(r, world, per_host)
        if world == 1:
            assert b is None
            continue
        assert b is not None and b != r and 0 <= b < world
        if world > per_host:  # at least two hosts
            assert host_of(b, per_host) != host_of(r, per_host), (r, b, world, per_host)
    # every rank's copy is kept by somebody, and owners_of is the inverse of buddy_of
    if world > 1:
        kept = sorted(o for k in range(world) for o in owners_of(k, world, per_host))
        assert kept == list(range(world))


def test_bad_placement_input_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"rank 4 is outside 0\.\.3"):
        buddy_of(4, 4, 2)


def test_buddy_flag_auto_means_no_replica() -> None:
    assert buddies_wanted("auto", (1, 4)) and not buddies_wanted("auto", (2, 2))
    assert buddies_wanted("on", (2, 2)) and not buddies_wanted("off", (1, 4))
    assert not buddies_wanted("on", (4, 1))  # S = 1: every rank holds the whole model
    with pytest.raises(ConfigError, match="'sometimes'"):
        buddies_wanted("sometimes", (1, 4))


# -- plans -----------------------------------------------------------------------------------------
def _fsdp(
    states: dict[int, tuple[int, bool]],
    copies: dict[int, list[tuple[int, int]]],
    snaps: dict[int, list[int]] | None = None,
    n: int = 4,
    step: int = 5,
    shape: tuple[int, int] = (1, 4),
) -> list[MemberReport]:
    snaps = snaps or {}
    return [
        MemberReport(
            r,
            *states.get(r, (step, True)),
            mesh=shape,
            copies=tuple(copies.get(r, [])),
            own_snapshots=tuple(snaps.get(r, [])),
        )
        for r in range(n)
    ]


def _ring_copies(steps: list[int], lost: set[int], n: int = 4) -> dict[int, list[tuple[int, int]]]:
    """Keeper -> its kept copies on a one-host ring (rank r's copy on r + 1), lost keepers empty."""
    return {(o + 1) % n: [(o, s) for s in steps] for o in range(n) if (o + 1) % n not in lost}


def test_a_lost_rank_takes_its_shard_from_its_buddy_copy() -> None:
    plan = plan_recovery(_fsdp({2: (-1, False)}, _ring_copies([4, 5], lost={2})))
    assert plan.target_step == 5 and plan.receivers == (2,)
    assert plan.source_of() == {2: 3} and plan.from_copy == (2,) and plan.kind_of(2) == "copy"
    assert plan.to_json()["from_copy"] == [2]


def test_a_replica_wins_over_a_buddy_copy() -> None:
    # HSDP 2x2 with copies on: rank 1's shard is held by rank 3 (a replica) and kept by rank 2
    copies = {2: [(1, 5)]}
    plan = plan_recovery(_fsdp({1: (-1, False)}, copies, shape=(2, 2)))
    assert plan.source_of() == {1: 3} and plan.from_copy == ()


def test_a_copy_not_yet_kept_rolls_everyone_back_to_the_lost_ranks_newest_copy() -> None:
    # rank 1 died as step 5 began: its copy of 5 never arrived, rank 2 keeps 4. Every survivor
    # rolls back from its own state of step 4 (in its memory), though 2's and 3's keepers hold
    # it too: nothing but the lost rank's shard crosses the network.
    copies = {2: [(1, 3), (1, 4)], 3: [(2, 4), (2, 5)], 0: [(3, 4), (3, 5)]}
    snaps = {0: [4, 5], 2: [4, 5], 3: [4, 5]}
    plan = plan_recovery(_fsdp({1: (-1, False)}, copies, snaps))
    assert plan.target_step == 4
    assert plan.source_of() == {1: 2} and plan.from_copy == (1,)
    assert plan.own_snapshot == (0, 2, 3) and plan.kind_of(0) == "own_snapshot"
    assert plan.receivers == (0, 1, 2, 3)


def test_a_survivor_without_its_own_state_of_the_target_takes_it_from_its_keeper() -> None:
    # as above, but rank 3 kept only its state of step 5 (its undo copy of 4 already dropped)
    copies = {2: [(1, 3), (1, 4)], 3: [(2, 4), (2, 5)], 0: [(3, 4), (3, 5)]}
    snaps = {0: [4, 5], 2: [4, 5], 3: [5]}
    plan = plan_recovery(_fsdp({1: (-1, False)}, copies, snaps))
    assert plan.target_step == 4
    assert plan.source_of() == {1: 2, 3: 0} and plan.from_copy == (1, 3)
    assert plan.own_snapshot == (0, 2)


def test_two_lost_ranks_whose_copies_are_on_each_other_fall_back_to_their_own_snapshots() -> None:
    # ranks 1 and 2 lost: 1's copy was on 2, so 1 loads its own snapshot (its host survived)
    copies = _ring_copies([4, 5], lost={1, 2})
    plan = plan_recovery(_fsdp({1: (-1, False), 2: (-1, False)}, copies, {1: [4, 5], 2: [4, 5]}))
    assert plan.target_step == 5
    assert plan.source_of() == {2: 3} and plan.from_copy == (2,) and plan.own_snapshot == (1,)


def test_holder_and_buddy_lost_without_a_snapshot_is_a_clear_error_naming_the_ranks() -> None:
    copies = _ring_copies([4, 5], lost={1, 2})
    with pytest.raises(NotRecoverableError, match=r"ranks \[1, 2\].*--buddy-copies.*--snapshot-every"):
        plan_recovery(_fsdp({1: (-1, False), 2: (-1, False)}, copies))


def test_a_copy_is_never_taken_from_its_owner_itself() -> None:
    # a report that claims to keep its own copy is ignored: that copy dies with the owner
    with pytest.raises(NotRecoverableError):
        plan_recovery(_fsdp({1: (-1, False)}, {1: [(1, 5)]}))


@given(
    st.sets(st.integers(0, 3), max_size=3),
    st.sets(st.integers(3, 6), max_size=3),
    st.booleans(),
)
def test_every_plan_gives_every_rank_its_own_shard_at_one_step(
    lost: set[int], kept_steps: set[int], with_snaps: bool
) -> None:
    """Whatever is lost, a plan either names for every rank a source that really holds that
    rank's shard at the target step, or raises; it never leaves a rank without its shard."""
    copies = _ring_copies(sorted(kept_steps), lost)
    snaps = {r: [5] for r in range(4)} if with_snaps else {}
    reports = _fsdp({r: (-1, False) for r in lost}, copies, snaps)
    try:
        plan = plan_recovery(reports)
    except NotRecoverableError:
        return
    by_rank = {m.rank: m for m in reports}
    src = plan.source_of()
    for m in reports:
        if m.valid and m.committed_step == plan.target_step:
            assert m.rank not in plan.receivers
        elif m.rank in plan.own_snapshot:
            assert plan.target_step in m.own_snapshots
        else:
            s = by_rank[src[m.rank]]
            assert s.rank != m.rank
            if m.rank in plan.from_copy:
                assert (m.rank, plan.target_step) in s.copies
            else:
                assert s.valid and s.committed_step == plan.target_step and s.rank % 4 == m.rank % 4


def test_nothing_in_memory_falls_back_to_every_ranks_own_checkpoint_of_one_step() -> None:
    reports = [MemberReport(r, -1 if r == 1 else 7, r != 1, checkpoint_step=6, mesh=(1, 4)) for r in range(4)]
    plan = plan_recovery(reports)
    assert plan.from_checkpoint and plan.target_step == 6 and plan.receivers == (0, 1, 2, 3)
    # ranks whose newest checkpoints differ (one save failed) have no common step: the error
    reports[2] = MemberReport(2, 7, True, checkpoint_step=3, mesh=(1, 4))
    with pytest.raises(NotRecoverableError, match=r"ranks \[1\]"):
        plan_recovery(reports)


def test_copies_are_due_every_n_steps_and_at_each_generations_first_step() -> None:
    # every step with N = 1, whatever the generation
    assert all(copy_due(s, 1, copied_in=0, generation=0) for s in range(7))
    # N = 3 in generation 0, a copy already made in it: steps 0, 3, 6 only
    assert [s for s in range(8) if copy_due(s, 3, copied_in=0, generation=0)] == [0, 3, 6]
    # a new generation (resumed at step 4): copy at once, then back to the multiples of 3
    assert copy_due(4, 3, copied_in=0, generation=1)
    assert [s for s in range(5, 10) if copy_due(s, 3, copied_in=1, generation=1)] == [6, 9]


@pytest.mark.parametrize("every", [0, -3])
def test_a_bad_copy_interval_is_refused_naming_the_flag_and_the_fix(every: int) -> None:
    from checkpointless.launcher.model import LaunchConfig

    with pytest.raises(ConfigError, match=rf"--buddy-every must be .*\(got {every}\).*--buddy-copies off"):
        LaunchConfig(script=__file__, buddy_every=every).validate()
