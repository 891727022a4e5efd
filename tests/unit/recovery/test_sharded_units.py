"""Pure parts of sharded jobs: the shard identity a transfer carries, mesh-shape checks, and
which of its own states a rank offers a plan."""

from __future__ import annotations

import pytest

from checkpointless.errors import StateTransferError
from checkpointless.protocol import ResumePlan
from checkpointless.recovery.replicas import ReplicaKeeper
from checkpointless.recovery.sharded import ShardIdentity, mesh_shape_error

pytestmark = pytest.mark.timeout(10)


def test_a_shard_of_another_coordinate_is_refused() -> None:
    sent = ShardIdentity((2, 2), 0).state_dict()
    ShardIdentity((2, 2), 0).load_state_dict(sent)  # the same coordinate: accepted
    with pytest.raises(StateTransferError, match="shard 0 of a 2x2 mesh; this rank holds shard 1"):
        ShardIdentity((2, 2), 1).load_state_dict(sent)
    with pytest.raises(StateTransferError, match="1x4"):
        ShardIdentity((1, 4), 0).load_state_dict(sent)


@pytest.mark.parametrize(
    "names,shape,world,match",
    [
        (("replicate", "shard"), (2, 2), 4, None),
        (("shard",), (4,), 4, None),
        (("replicate", "shard"), (2, 3), 4, "covers 6 ranks but the job has 4"),
        (("replicate",), (2, 2), 4, r"give \('replicate', 'shard'\)"),
        (("a", "b", "c"), (1, 2, 2), 4, r"give \('replicate', 'shard'\)"),
        (("replicate", "shard"), (0, 4), 4, "covers 0 ranks"),
    ],
)
def test_mesh_shape_errors_name_the_bad_value(
    names: tuple[str, ...], shape: tuple[int, ...], world: int, match: str | None
) -> None:
    err = mesh_shape_error(names, shape, world)
    if match is None:
        assert err is None
    else:
        assert err is not None
        with pytest.raises(type(err), match=match):
            raise err


def test_plan_sources_per_receiver_and_single_source() -> None:
    assert ResumePlan(0, 0, receivers=[1, 3], sources=[[1, 3], [3, 1]]).source_of() == {1: 3, 3: 1}
    assert ResumePlan(0, 2, receivers=[0, 1]).source_of() == {0: 2, 1: 2}
    assert ResumePlan(0, -1, receivers=[0, 1], from_snapshot=True).source_of() == {}


def test_divergence_is_judged_among_the_replicas_of_each_shard() -> None:
    from checkpointless.recovery.commit import judge_replicas

    # 3x2 mesh: ranks 0, 2, 4 hold shard 0 and ranks 1, 3, 5 shard 1; the shards differ
    assert judge_replicas([7, 9, 7, 9, 7, 9], 2).divergent == ()
    v = judge_replicas([7, 9, 7, 8, 7, 9], 2)  # rank 3 differs from its shard's other replicas
    assert v.divergent == (3,) and v.has_majority
    v = judge_replicas([7, 9, 6, 9], 2)  # two replicas of shard 0 differ: neither can be trusted
    assert v.divergent == (0, 2) and not v.has_majority
    assert judge_replicas([5, 5, 6], 1).divergent == (2,)  # plain data parallel: one column


class _Undo:
    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def undo_steps(self) -> list[int]:
        return self.steps


def test_a_rank_found_divergent_offers_none_of_its_earlier_own_states() -> None:
    # A rank healed at step 8 after a divergence check: its undo copies of steps 7 and 8 may
    # hold the divergent state, so a later plan must not roll it back to one of them; the undo
    # copy of step 9, taken after it received the majority's state, is offered.
    keeper = ReplicaKeeper()
    keeper.buddies = _Undo([7, 8, 9])  # type: ignore[assignment]
    assert keeper.own_states() == [7, 8, 9]
    keeper.own_states_after = 8
    assert keeper.own_states() == [9]
