"""Degraded mode and the groups a script made (issue 39): which fold on their holder, which no
process forms, and which end the job with why (comm/group_catalog.py, a pure rule)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from checkpointless.comm.group_catalog import GroupEntry, held_groups


def mesh_groups(dp: int, shard: int, tp: int) -> list[GroupEntry]:
    """The groups init_device_mesh makes on a row-major (dp, shard, tp) mesh: each dimension's,
    in torch's order (dp, then shard, then tp), named by their creation number."""
    ranks = [(d, s, t) for d in range(dp) for s in range(shard) for t in range(tp)]
    rank = {c: i for i, c in enumerate(ranks)}
    out: list[GroupEntry] = []
    for dim, size in enumerate((dp, shard, tp)):
        rows = {tuple(c[:dim] + c[dim + 1 :]) for c in ranks}
        for row in sorted(rows):
            members = tuple(sorted(rank[(*row[:dim], i, *row[dim:])] for i in range(size)))
            out.append(GroupEntry(str(len(out)), members))
    return out


def test_a_3d_meshs_dp_groups_fold_on_their_holders_and_the_lost_groups_own_are_left() -> None:
    # replica group 1 (ranks 4-7) left; rank r holds slot r + 4 of the same (shard, tp)
    plan = held_groups(mesh_groups(2, 2, 2), {4: 0, 5: 1, 6: 2, 7: 3})
    assert plan.refusal is None
    folded = {
        e.ranks: holder for e in mesh_groups(2, 2, 2) for key, holder in plan.folded.items() if e.key == key
    }
    assert folded == {(0, 4): 0, (1, 5): 1, (2, 6): 2, (3, 7): 3}


def test_a_group_mixing_live_ranks_and_held_slots_is_refused_naming_it() -> None:
    world = GroupEntry("9", tuple(range(8)))  # a flattened data-parallel group, or every rank's
    plan = held_groups([*mesh_groups(2, 2, 2), world], {4: 0, 5: 1, 6: 2, 7: 3})
    assert plan.refusal is not None
    assert "dist.new_group #9 over ranks [0, 1, 2, 3, 4, 5, 6, 7]" in plan.refusal
    assert "--when-no-spare fail" in plan.refusal and "--spares" in plan.refusal


def test_a_pair_whose_held_member_another_rank_holds_is_refused() -> None:
    # {0, 4} with slot 4 held by rank 1: rank 0 is not every member of it
    plan = held_groups([GroupEntry("1", (0, 4))], {4: 1})
    assert plan.refusal is not None and "[0, 4]" in plan.refusal


def test_at_full_width_nothing_folds() -> None:
    plan = held_groups(mesh_groups(2, 2, 2), {})
    assert plan.folded == {} and plan.refusal is None


@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([0, 1]))
def test_on_any_2_by_s_by_t_mesh_each_survivor_folds_exactly_its_dp_group(
    shard: int, tp: int, lost: int
) -> None:
    per = shard * tp
    holders = {lost * per + i: (1 - lost) * per + i for i in range(per)}
    entries = mesh_groups(2, shard, tp)
    plan = held_groups(entries, holders)
    assert plan.refusal is None
    by_key = {e.key: e for e in entries}
    assert sorted(plan.folded.values()) == sorted(holders.values())
    for key, holder in plan.folded.items():
        assert set(by_key[key].ranks) == {holder, *(s for s, h in holders.items() if h == holder)}
