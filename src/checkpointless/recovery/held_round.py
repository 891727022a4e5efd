"""Degraded mode's part of a worker's recovery round: the checks and records of the replica
slots a survivor holds for lost ranks (recovery/slots.py holds their groups).

Before the generation forms, the groups the script made along the replicate dimension fold on
the rank that holds their held slots, and a held slot inside any other group the script made
ends the job with why (no process of its own could join it); once the state is in place, the
holder fetches the held slots' generator records that its own host does not have.
"""

from __future__ import annotations

from checkpointless.comm.group_catalog import held_groups
from checkpointless.errors import ConfigError
from checkpointless.protocol import Recover
from checkpointless.recovery.member import Member
from checkpointless.state.buddy_ring import buddy_of
from checkpointless.state.transfer import StreamRoute

__all__ = ["HeldSlotsInScriptGroups", "fetch_held_records", "fold_held_script_groups"]


def fetch_held_records(member: Member, holders: list[list[int]], target: int, route: StreamRoute) -> None:
    """Degraded mode: each slot this process holds whose record of ``target`` is not on this
    host (its lost rank's host went with its shared memory) is asked of the lost rank's keeper
    on another host, as a replacement asks for its own; and the records the holder keeps for
    the slot go to that keeper from now on (recovery/slot_rng.py)."""
    mine = [slot for slot, holder in holders if holder == member.rank]
    if not mine:
        return
    keepers = {slot: buddy_of(slot, member.world_size, member.placement[1]) for slot in mine}
    timeout = min(member.rendezvous_timeout, 10.0)
    for slot in member.held_rng.missing(mine, target, member.job_id):
        record = member.replicas.rank_rng_peer.fetch_of(route, slot, keepers[slot], target, timeout)
        if record is not None:
            member.held_rng.provide(slot, record)
    member.held_rng.mirror(keepers, member.job_id, member.generation, route)


class HeldSlotsInScriptGroups(ConfigError):
    """A group the script made with ``dist.new_group`` includes a slot held in degraded mode."""


def fold_held_script_groups(member: Member, msg: Recover) -> None:
    """Before the generation forms: fold the groups the script made that this process is every
    live member of, its held slots being the rest (the replicate dimension of a mesh the script
    made with ``init_device_mesh``), and unfold them at full width (comm/group_catalog.py,
    ``held_groups``). A group that mixes other live ranks with held slots cannot form without a
    process for each held slot (none joins it, and the generation would wait out its deadline
    on every rank, again in every round after): end the job with why."""
    made = member.groups.default.made if member.groups.default is not None else None
    if made is None:
        return
    plan = held_groups(made.entries(), {slot: holder for slot, holder in msg.plan.holders})
    if plan.refusal is not None:
        raise HeldSlotsInScriptGroups(plan.refusal)
    made.fold(frozenset(key for key, holder in plan.folded.items() if holder == member.rank))
