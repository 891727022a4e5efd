"""Recovery by coordinates (comm/mesh_coords.py): which ranks hold a rank's state on a mesh, and
the (R, S) form the recovery plan takes it in. Pure functions, checked on the meshes the jobs use
(dp x tp, HSDP, replicate x FSDP x TP) and exhaustively against the plan's ``r % S`` rule."""

from __future__ import annotations

import itertools

import pytest

from checkpointless.comm.mesh_coords import MeshLayout, mesh_order_error
from checkpointless.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


def test_dp_by_tp_rank_takes_its_state_from_the_same_tp_coordinate_of_the_other_replica() -> None:
    layout = MeshLayout.of(("dp", "tp"), (2, 2), sharded={"tp"})
    assert [layout.coordinates(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [layout.state_coordinates(r) for r in range(4)] == [(0,), (1,), (0,), (1,)]
    # (dp=0, tp=1) is held again only by (dp=1, tp=1), never by a rank of tp coordinate 0
    assert {r: layout.holders(r) for r in range(4)} == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert layout.plan_shape() == (2, 2)


def test_hsdp_is_the_same_rule_with_shard_for_tp() -> None:
    layout = MeshLayout.of(("replicate", "shard"), (2, 3), sharded={"shard"})
    assert layout.plan_shape() == (2, 3)
    assert layout.holders(4) == [1]


def test_three_dimensions_replicate_by_fsdp_by_tp() -> None:
    layout = MeshLayout.of(("dp", "fsdp", "tp"), (2, 2, 2), sharded={"fsdp", "tp"})
    assert layout.plan_shape() == (2, 4)
    assert layout.state_coordinates(5) == (0, 1)  # rank 5 = (dp 1, fsdp 0, tp 1)
    assert layout.holders(5) == [1]


def test_no_replicate_dimension_means_every_state_exists_once() -> None:
    layout = MeshLayout.of(("fsdp", "tp"), (2, 2), sharded={"fsdp", "tp"})
    assert layout.plan_shape() == (1, 4)
    assert all(layout.holders(r) == [] for r in range(4))


def test_nothing_split_is_plain_data_parallel() -> None:
    layout = MeshLayout.of(("dp", "tp"), (2, 2), sharded=set())
    assert layout.plan_shape() == (4, 1)
    assert layout.holders(0) == [1, 2, 3]


def test_a_replicate_dimension_after_a_split_one_is_refused_with_the_fix() -> None:
    layout = MeshLayout.of(("tp", "dp"), (2, 2), sharded={"tp"})
    assert layout.holders(0) == [1]  # the rule itself still holds ...
    with pytest.raises(ConfigError, match="put the replicate"):
        layout.plan_shape()  # ... but the plan's r % S cannot express it


def test_bad_layouts_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        MeshLayout(("a", "a"), (2, 2), frozenset())
    with pytest.raises(ConfigError):
        MeshLayout(("a",), (2, 2), frozenset())
    with pytest.raises(ConfigError):
        MeshLayout(("a",), (2,), frozenset({"b"}))
    with pytest.raises(ConfigError):
        MeshLayout.of(("a",), (2,), sharded={"a"}).coordinates(2)


@pytest.mark.parametrize("shape", [(2,), (2, 2), (3, 2), (2, 3, 2), (2, 2, 2, 2)])
def test_holders_agree_with_the_plans_rule_whenever_replicate_dimensions_lead(shape: tuple[int, ...]) -> None:
    names = tuple(f"d{i}" for i in range(len(shape)))
    for lead in range(len(shape) + 1):  # the first `lead` dimensions replicate
        layout = MeshLayout.of(names, shape, sharded=set(names[lead:]))
        replicas, states = layout.plan_shape()
        assert replicas * states == layout.world_size
        for r in range(layout.world_size):
            want = [h for h in range(layout.world_size) if h != r and h % states == r % states]
            assert layout.holders(r) == want, (shape, lead, r)


def test_every_other_choice_of_replicate_dimensions_is_either_the_plans_rule_or_refused() -> None:
    names, shape = ("a", "b", "c"), (2, 2, 2)
    for k in range(4):
        for split in itertools.combinations(names, k):
            layout = MeshLayout.of(names, shape, sharded=set(split))
            try:
                _, states = layout.plan_shape()
            except ConfigError:
                continue
            assert all(
                layout.holders(r) == [h for h in range(8) if h != r and h % states == r % states]
                for r in range(8)
            ), split


def test_mesh_order() -> None:
    assert mesh_order_error([0, 1, 2, 3], 4) is None
    assert mesh_order_error([0, 2, 1, 3], 4) is not None
    assert mesh_order_error([0, 1], 4) is not None
