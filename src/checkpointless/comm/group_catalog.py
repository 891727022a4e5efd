"""The catalog of groups a script made: what each rank made, whether they agree, and what degraded
mode does with each. Pure functions over :class:`GroupEntry` values, so that every rank (and the
tests) reach the same answer from the same lists; comm/script_groups.py publishes the lists and
forms the groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from checkpointless.errors import ConfigError

__all__ = [
    "GroupEntry",
    "GroupsDisagree",
    "HeldGroups",
    "disagreement",
    "group_key",
    "held_groups",
    "parse_catalog",
]


class GroupsDisagree(ConfigError):
    """Ranks made different groups: a group that some of its ranks never made cannot form."""


def group_key(name: str, ranks: Sequence[int]) -> str:
    """The store key of the group torch named ``name`` (its creation sequence number, or a hash
    of its ranks under ``use_local_synchronization``) over ``ranks``. Pure: every member of every
    generation derives the same key. Long rank lists are hashed so that keys stay short."""
    if len(ranks) <= 8:
        return f"g{name}.r" + ".".join(str(r) for r in ranks)
    digest = hashlib.sha256(",".join(str(r) for r in ranks).encode()).hexdigest()[:16]
    return f"g{name}.n{len(ranks)}.{digest}"


@dataclass(frozen=True)
class GroupEntry:
    """One ``dist.new_group`` call as this rank made it: torch's name and the ranks."""

    name: str
    ranks: tuple[int, ...]

    @property
    def key(self) -> str:
        return group_key(self.name, self.ranks)

    def line(self) -> str:
        return f"{self.name}:" + ",".join(str(r) for r in self.ranks)

    def describe(self) -> str:
        return f"dist.new_group #{self.name} over ranks {list(self.ranks)}"


def parse_catalog(text: str) -> set[GroupEntry]:
    """The entries of a catalog of :meth:`GroupEntry.line` lines (the inverse of publishing)."""
    out: set[GroupEntry] = set()
    for line in text.splitlines():
        if line.strip():
            name, _, ranks = line.partition(":")
            out.add(GroupEntry(name, tuple(int(r) for r in ranks.split(",") if r)))
    return out


def disagreement(
    mine: Sequence[GroupEntry],
    rank: int,
    catalogs: Mapping[int, set[GroupEntry]],
    only: GroupEntry | None = None,
) -> str | None:
    """Why the groups cannot form, or None if all agree: each group with ``rank`` among its ranks,
    made here (``mine``: this rank's live groups) or by a peer (``catalogs``: peer rank -> its
    live groups), that one of its members whose list is known has not made. With ``only``, that
    group alone is judged: a rank still making its groups knows only the ones made so far, and a
    peer's later ones are not missing here, only not made yet."""
    lists = {**catalogs, rank: set(mine)}
    seen = {e for r, entries in lists.items() for e in entries if rank in e.ranks}
    if only is not None:
        seen &= {only}
    problems = []
    for e in sorted(seen, key=lambda x: (_seq(x.name), x.ranks)):
        missing = [r for r in e.ranks if r in lists and e not in lists[r]]
        if missing:
            makers = [r for r in e.ranks if r in lists and e in lists[r]]
            problems.append(
                f"{e.describe()} was made by ranks {makers} but not by ranks {missing}"
                + _what_they_made(e, missing, lists)
            )
    if not problems:
        return None
    return (
        "; ".join(problems) + ". Every rank must call dist.new_group (and dist.new_subgroups) the "
        "same number of times, in the same order and with the same ranks, members or not (torch "
        "requires it too), and make its groups before job.steps() so that a replacement rank makes "
        "them again"
    )


def _seq(name: str) -> int:
    return int(name) if name.isdigit() else -1


def _what_they_made(e: GroupEntry, missing: list[int], catalogs: Mapping[int, set[GroupEntry]]) -> str:
    same_name = sorted({str(list(x.ranks)) for r in missing for x in catalogs[r] if x.name == e.name})
    return f" (their #{e.name} is over ranks {', '.join(same_name)})" if same_name else ""


@dataclass(frozen=True)
class HeldGroups:
    """Degraded mode's view of the script's groups (:func:`held_groups`)."""

    folded: dict[str, int]  # group key -> the one process that is every member of it
    refusal: str | None  # why the groups cannot go on degraded, or None


def held_groups(entries: Sequence[GroupEntry], holders: Mapping[int, int]) -> HeldGroups:
    """What degraded mode does with each group the script made, given ``holders`` (a held slot ->
    the live rank that trains its passes besides its own).

    - A group with no held slot forms as at full width.
    - A group of held slots only (the lost replica group's own: its tensor-parallel and shard
      groups) has no process left to form it, and none needs it: a held slot's passes run in its
      holder's own groups, whose members hold the same shards (coordinator/rules/mesh_width.py).
    - A group whose one live member holds every held member (the holder's group along the
      replicate dimension, {(dp 0, s, t), (dp 1, s, t)}) is *folded* on that member: it forms no
      communicator, FSDP2's replicate all-reduce of the accumulated passes is finished there,
      and any other collective on it is refused (comm/folded.py).
    - Any other group mixes live processes with held slots (a flattened data-parallel group, or
      one over every rank): its held members would need a process of their own to join it. It
      cannot go on degraded, and :attr:`HeldGroups.refusal` names it."""
    folded: dict[str, int] = {}
    problems: list[str] = []
    for e in entries:
        held = [r for r in e.ranks if r in holders]
        live = [r for r in e.ranks if r not in holders]
        if not held or not live:
            continue
        if len(live) == 1 and all(holders[r] == live[0] for r in held):
            folded[e.key] = live[0]
        else:
            problems.append(f"{e.describe()} includes the lost slot(s) {held} beside the live rank(s) {live}")
    refusal = None
    if problems:
        refusal = (
            "degraded mode cannot go on: "
            + "; ".join(problems)
            + ". A held slot has no process of its own to join a group the script made; degraded "
            "mode forms only the groups along the replicate dimension, folded on the rank that "
            "holds the slot (docs/fault-model.md, degraded mode). Keep a spare ready (--spares), or "
            "run such a script with --when-no-spare fail"
        )
    return HeldGroups(folded, refusal)
