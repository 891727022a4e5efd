"""Degraded mode on a (replicate, shard) mesh (HSDP, issue 39): pure rules, no I/O, no clock.

A data-parallel job drops a lost rank's slot alone (``width.py``). On a (R, S) mesh a rank holds
one shard of one replica, and its shard group (its replica group's S ranks) all-gathers the
parameters for every forward: a replica group missing one rank cannot compute at all. So the
lost rank's *whole replica group* leaves, and each of its slots (g, s) is held by the rank of a
surviving group with the same shard coordinate s, which holds that shard already (its replica is
the lost group's). The held slots' passes then run in the holder's own shard group: the
reduce-scatter of the held group's micro-batches is made by ranks that hold the same shards, and
the replicate all-reduce is finished locally (comm/folded.py). The group's surviving ranks leave
the job (their processes are stopped; the spare pool starts processes for every held slot), and
when S spares are ready the group comes back whole (:func:`mesh_groups_to_grow`).

Bitwise only with R = 2: the full job's all-reduce over two replicas is one addition, which the
holder makes in the other order, with the same result; over three or more the sum would be
associated differently. :func:`mesh_not_shrinkable` says so for other meshes, and the job then
waits for a spare or fails as before.

Ranks are row-major over the mesh (comm/mesh.py): rank r is shard ``r % S`` of group ``r // S``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["assign_mesh_slots", "mesh_groups_to_grow", "mesh_leaving", "mesh_not_shrinkable"]


def mesh_not_shrinkable(mesh: tuple[int, int], lost: Iterable[int] = ()) -> str:
    """Why a job on the (R, S) ``mesh`` cannot drop the replica groups of the ``lost`` slots
    ("" when it can)."""
    replicate, shards = mesh
    groups = sorted({slot // shards for slot in lost})
    if replicate == 1:
        return (
            f"a {replicate}x{shards} mesh (plain FSDP) has no other replica group holding the lost "
            "rank's shard; run with R >= 2 (job.device_mesh(..., (2, S))) to go on degraded"
        )
    if replicate != 2:
        return (
            f"a {replicate}x{shards} mesh would have to sum {replicate - 1} replica groups in another "
            "order than the full job and lose bitwise equality; degraded HSDP is built for 2 "
            "replica groups (docs/fault-model.md)"
        )
    if len(groups) >= replicate:
        return (
            f"slot(s) {sorted(set(lost))} of the {replicate}x{shards} mesh are in every replica group "
            f"({groups}): no group is left whole to hold the others' shards"
        )
    return ""


def mesh_leaving(lost: Iterable[int], shards: int, live: Iterable[int]) -> list[int]:
    """The ranks of ``live`` (processes that hold their own slot now) that leave with the
    replica groups of the ``lost`` slots: the groups' survivors, sorted."""
    groups = {slot // shards for slot in lost}
    return sorted(r for r in set(live) if r // shards in groups and r not in set(lost))


def assign_mesh_slots(
    holders: Mapping[int, Sequence[int]], lost: Sequence[int], shards: int
) -> dict[int, list[int]]:
    """Give every slot of the replica groups in ``lost`` to a surviving process with the same
    shard coordinate. ``holders`` maps each live process that stays (by its own rank) to the
    slots it holds now; ``lost`` holds every slot of the leaving groups (the lost ranks and
    :func:`mesh_leaving`'s). Each leaving group goes whole to the surviving group whose ranks
    hold the fewest slots (the lowest group on a tie), so that its S held passes run in one
    shard group. Returns the new holders, every slot list sorted; raises ValueError when no
    replica group survives whole."""
    out = {p: sorted(slots) for p, slots in holders.items()}
    alive = {p // shards for p in out}
    whole = sorted(g for g in alive if all(g * shards + s in out for s in range(shards)))
    if not whole:
        raise ValueError(f"assign_mesh_slots: no replica group survives whole (live ranks {sorted(out)})")
    leaving = sorted({slot // shards for slot in lost})
    for group in leaving:
        if group in whole:
            raise ValueError(f"assign_mesh_slots: replica group {group} is both lost and live")
        target = min(whole, key=lambda g: (len(out[g * shards]), g))
        for s in range(shards):
            out[target * shards + s] = sorted([*out[target * shards + s], group * shards + s])
    return out


def mesh_groups_to_grow(holders: Mapping[int, Sequence[int]], ready: int, shards: int) -> list[int]:
    """The held slots that ``ready`` spares take back at the next step boundary, sorted: whole
    replica groups only (S spares each; fewer ready spares take none back), the highest held
    group first (as ``slots_to_grow`` gives back the highest slot)."""
    held = sorted(
        {slot // shards for p, slots in holders.items() for slot in slots if slot != p},
        key=lambda g: -g,
    )
    back: list[int] = []
    for group in held[: max(0, ready) // max(1, shards)]:
        back.extend(group * shards + s for s in range(shards))
    return sorted(back)
