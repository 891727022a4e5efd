"""Degraded mode's part of a worker's recovery round: the checks and records of the replica
slots a survivor holds for lost ranks (recovery/slots.py holds their groups).

Before the generation forms, a held slot inside a group the script made ends the job with why
(no process of its own could join it); once the state is in place, the holder fetches the held
slots' generator records that its own host does not have.
"""

from __future__ import annotations

from checkpointless.errors import ConfigError
from checkpointless.protocol import Recover
from checkpointless.recovery.member import Member
from checkpointless.state.buddy_ring import buddy_of
from checkpointless.state.transfer import StreamRoute

__all__ = ["HeldSlotsInScriptGroups", "fetch_held_records", "refuse_held_slots_in_script_groups"]


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


def refuse_held_slots_in_script_groups(member: Member, msg: Recover) -> None:
    """A group the script made (``dist.new_group``; Lightning makes one of every rank) forms
    in each generation from every member's catalog, and a held slot has no process of its own
    to publish one or to join: the generation would wait out its deadline on every rank, again
    in every round after. Degraded mode does not form them (not built); end the job with why."""
    held = sorted(slot for slot, _ in msg.plan.holders)
    made = member.groups.default.made if member.groups.default is not None else None
    if not held or made is None:
        return
    for entry in made.entries():
        inside = sorted(set(held) & set(entry.ranks))
        if inside:
            raise HeldSlotsInScriptGroups(
                f"degraded mode cannot go on: {entry.describe()} includes the lost slot(s) "
                f"{inside}, which no process of its own can join (groups a script makes are not "
                "formed for held slots); run such a script with --when-no-spare fail "
                "(docs/fault-model.md, degraded mode)"
            )
