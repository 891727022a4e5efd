"""What a rank has done through torch.distributed before job.steps() (recovery/first_generation.py):
a fault before the first state sync makes a rank that has communicated start over, and lets one
that has not report to the next start-up round. Plain objects stand in for the job's groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from checkpointless.recovery.first_generation import START_OVER_EXIT, communicated

pytestmark = pytest.mark.timeout(30)


@dataclass
class _Group:
    issued: int = 0

    def __hash__(self) -> int:
        return id(self)


@dataclass
class _Made:
    made: list[_Group] = field(default_factory=list)
    outsiders: int = 0  # groups made whose members do not include this rank

    def groups(self) -> list[_Group]:
        return self.made

    def entries(self) -> list[object]:
        return [object()] * (len(self.made) + self.outsiders)


def _member(world: _Group, made: _Made | None = None, mesh: list[_Group] | None = None) -> Any:
    default = SimpleNamespace(pg=world, made=made)
    sharded = SimpleNamespace(mesh=SimpleNamespace(groups=mesh)) if mesh is not None else None
    return SimpleNamespace(groups=SimpleNamespace(default=default, mesh=sharded))


def test_a_rank_that_did_nothing_distributed_has_not_communicated() -> None:
    world = _Group()
    # a job.device_mesh() made and fully_shard applied: groups, but no collective and no new_group
    assert communicated(_member(world, _Made(), mesh=[world, _Group()])) is None


def test_collectives_on_any_group_count_once_per_group() -> None:
    world = _Group(issued=2)
    # the mesh's world group is the default group: counted once
    assert communicated(_member(world, _Made(), mesh=[world, _Group(issued=1)])) == "ran 3 collective(s)"
    assert communicated(_member(_Group(), _Made([_Group(issued=4)]))) == "ran 4 collective(s)"


def test_a_group_made_with_new_group_counts_even_without_a_collective() -> None:
    # a replacement starting from the top would make it again and find no partner for it
    assert communicated(_member(_Group(), _Made(outsiders=1))) == "made 1 group(s) with dist.new_group"


def test_the_start_over_exit_is_an_ordinary_failure_to_the_launcher() -> None:
    from checkpointless.errors import CONFIG_ERROR_EXIT

    assert START_OVER_EXIT not in (0, 1, CONFIG_ERROR_EXIT)
