"""Which live process holds which data-parallel slot while the job runs degraded.

At full width every rank's process holds its own slot. After a round that shrank the job
(``--when-no-spare shrink|wait``, coordinator/rules/width.py), a survivor also holds a lost slot:
the coordinator's member table then maps that slot to the survivor's member (one process under
two ranks), every message to "each rank" goes once per process, and whatever a holder reports
(where it stopped, that it formed the generation, its first commit) counts for its held slots
too, since their state is its own. A spare that becomes ready takes a held slot back in a round of
its own at a step boundary (``grow``). The decisions are the pure rules of ``rules/width.py``;
this is their bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from checkpointless.coordinator.rules.mesh_width import assign_mesh_slots, mesh_groups_to_grow
from checkpointless.coordinator.rules.width import assign_slots, slots_to_grow

__all__ = ["SlotHolders", "unique"]

T = TypeVar("T")


def unique(members: Iterable[T]) -> list[T]:
    """Each member once, in order (a holder stands in the member table once per slot it holds)."""
    seen: set[int] = set()
    out: list[T] = []
    for m in members:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


class SlotHolders:
    """slot -> the rank whose process holds it, for every held-over slot (empty: full width)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}

    @property
    def degraded(self) -> bool:
        return bool(self.held)

    def width(self, nproc: int) -> int:
        """Live processes holding slots."""
        return nproc - len(self.held)

    def holder(self, slot: int) -> int:
        """The rank whose process trains ``slot`` (its own at full width)."""
        return self.held.get(slot, slot)

    def of(self, rank: int) -> list[int]:
        """The slots ``rank``'s process holds besides its own."""
        return sorted(slot for slot, h in self.held.items() if h == rank)

    def layout(self, nproc: int, leaving: Iterable[int] = ()) -> dict[int, list[int]]:
        """Every live process (by its own rank) and the slots it holds, without ``leaving``."""
        gone = set(leaving) | set(self.held)
        return {r: sorted([r, *self.of(r)]) for r in range(nproc) if r not in gone}

    def lose(self, rank: int) -> list[int]:
        """``rank``'s process is lost: the slots it held are lost with it (returned)."""
        slots = self.of(rank)
        for slot in slots:
            del self.held[slot]
        return slots

    def shrink(
        self, nproc: int, lost: list[int], leaving: Iterable[int], shards: int | None = None
    ) -> dict[int, int]:
        """Give every slot in ``lost`` to a survivor (not one of ``leaving``, the processes this
        round replaces); returns slot -> holder for them. On a mesh (``shards``: its S) ``lost``
        is whole replica groups, each held by the ranks of its shard coordinates."""
        for slot in lost:  # a held slot whose spare never came is held anew
            self.held.pop(slot, None)
        live = self.layout(nproc, leaving)
        after = assign_slots(live, lost) if shards is None else assign_mesh_slots(live, lost, shards)
        given = {slot: p for p, slots in after.items() for slot in slots if slot in set(lost)}
        self.held.update(given)
        return given

    def to_grow(self, nproc: int, ready: int, shards: int | None = None) -> list[int]:
        """The held slots that ``ready`` spares take back (rules/width.py's choice; on a mesh,
        whole replica groups: rules/mesh_width.py's)."""
        if shards is not None:
            return mesh_groups_to_grow(self.layout(nproc), ready, shards)
        return slots_to_grow(self.layout(nproc), ready)

    def release(self, slot: int) -> None:
        """A spare took ``slot``: its process is its own again."""
        self.held.pop(slot, None)

    def pairs(self) -> list[list[int]]:
        """As the plan carries them (ResumePlan.holders)."""
        return [[slot, h] for slot, h in sorted(self.held.items())]

    def spread(self, by_rank: Mapping[int, T], rank: int) -> dict[int, T]:
        """``rank``'s entry copied to every slot it holds (a report, a time)."""
        return {slot: by_rank[rank] for slot in self.of(rank)} if rank in by_rank else {}
