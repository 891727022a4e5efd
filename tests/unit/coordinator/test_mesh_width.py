"""Degraded mode's rules on an HSDP mesh (coordinator/rules/mesh_width.py): the lost rank's whole
replica group leaves, its slots go to the ranks of the same shard coordinate, and it comes back
whole."""

from __future__ import annotations

import pytest

from checkpointless.coordinator.rules.mesh_width import (
    assign_mesh_slots,
    mesh_groups_to_grow,
    mesh_leaving,
    mesh_not_shrinkable,
)

pytestmark = pytest.mark.timeout(60)


def test_only_a_mesh_of_two_replica_groups_can_drop_one() -> None:
    assert mesh_not_shrinkable((2, 2)) == ""
    assert mesh_not_shrinkable((2, 4)) == ""
    assert "plain FSDP" in mesh_not_shrinkable((1, 4))
    assert "bitwise" in mesh_not_shrinkable((3, 2))
    assert mesh_not_shrinkable((2, 2), [2]) == ""
    assert mesh_not_shrinkable((2, 2), [2, 3]) == ""
    # a rank lost in each group (or a holder lost with the slots it held): no group is whole
    assert "no group is left whole" in mesh_not_shrinkable((2, 2), [0, 3])


def test_the_lost_ranks_group_survivors_leave_with_it() -> None:
    # 2x2: rank 2 (group 1, shard 0) is lost; rank 3 (group 1, shard 1) leaves too
    assert mesh_leaving([2], 2, [0, 1, 3]) == [3]
    assert mesh_leaving([0], 2, [1, 2, 3]) == [1]
    # both ranks of group 1 lost: nobody else leaves
    assert mesh_leaving([2, 3], 2, [0, 1]) == []
    # 2x4: group 0 = 0..3
    assert mesh_leaving([1], 4, [0, 2, 3, 4, 5, 6, 7]) == [0, 2, 3]


def test_each_slot_goes_to_the_rank_of_its_shard_coordinate() -> None:
    # group 1 of a 2x2 leaves: slot 2 (shard 0) to rank 0, slot 3 (shard 1) to rank 1
    assert assign_mesh_slots({0: [0], 1: [1]}, [2, 3], 2) == {0: [0, 2], 1: [1, 3]}
    # group 0 leaves: its slots go to group 1's ranks of the same shard
    assert assign_mesh_slots({2: [2], 3: [3]}, [0, 1], 2) == {2: [0, 2], 3: [1, 3]}
    assert assign_mesh_slots({4: [4], 5: [5], 6: [6], 7: [7]}, [0, 1, 2, 3], 4) == {
        4: [0, 4],
        5: [1, 5],
        6: [2, 6],
        7: [3, 7],
    }


def test_no_whole_group_left_is_an_error_not_a_guess() -> None:
    with pytest.raises(ValueError, match="no replica group survives whole"):
        assign_mesh_slots({0: [0], 3: [3]}, [1, 2], 2)
    with pytest.raises(ValueError, match="both lost and live"):
        assign_mesh_slots({0: [0], 1: [1]}, [0, 1], 2)


def test_a_group_grows_back_only_whole() -> None:
    held = {0: [0, 2], 1: [1, 3]}
    assert mesh_groups_to_grow(held, 0, 2) == []
    assert mesh_groups_to_grow(held, 1, 2) == []  # one spare cannot bring a group of two back
    assert mesh_groups_to_grow(held, 2, 2) == [2, 3]
    assert mesh_groups_to_grow(held, 5, 2) == [2, 3]
    assert mesh_groups_to_grow({0: [0], 1: [1]}, 4, 2) == []  # full width: nothing to grow
