"""The job's data-parallel width when spares run out: pure rules, observed state in, an action out.

A data-parallel job has a fixed number of *slots* (``--nproc``): slot ``s`` at step ``t`` always
trains the same batch, so the sequence of global batches does not depend on which process trains
which slot. Normally every live process holds one slot. When a slot loses its process and no spare
can take it, the job either waits for one, fails, or goes on *degraded*: a survivor holds the lost
slot as well and trains its micro-batch as an extra accumulation pass of the same step
(docs/fault-model.md, "Degraded mode"). When a spare becomes ready later, it takes a slot back at a
step boundary and the job returns to full width.

Three rules, each a function of what the coordinator observed (no I/O, no clock):

* :func:`width_decision`: a round has ranks to replace; assign, wait, shrink or fail, under the
  ``--when-no-spare`` policy and ``--min-replicas``;
* :func:`assign_slots`: which survivor holds each lost slot (the least loaded first);
* :func:`slots_to_grow`: which held-over slots go back to ready spares;
* :func:`fold_held_slots`: a recovery plan as processes carry it out, a held slot's part done by
  its holder.

Under the ``fail`` policy :func:`width_decision` is exactly the old ``spare_policy``: start the
missing spares, wait up to ``--spare-wait``, then fail with the settings to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import replace as with_fields
from enum import Enum

from checkpointless.coordinator.rules.decisions import RecoveryPlan

__all__ = [
    "NoSparePolicy",
    "WidthAction",
    "WidthDecision",
    "WidthSituation",
    "assign_slots",
    "fold_held_slots",
    "ideal_step_time",
    "slots_to_grow",
    "width_decision",
]


class NoSparePolicy(str, Enum):
    """``--when-no-spare``: what a round does when no spare is ready for a lost slot."""

    SHRINK = "shrink"  # go on at once without it; the spares started meanwhile grow the job back
    WAIT = "wait"  # wait up to --spare-wait for a spare, then shrink
    FAIL = "fail"  # wait up to --spare-wait for a spare, then stop the job


class WidthAction(Enum):
    ASSIGN = "assign"  # a ready spare for every lost slot: replace them all now
    WAIT = "wait"  # assign the ready spares; wait for the rest (spawn what is missing)
    SHRINK = "shrink"  # assign the ready spares; survivors hold the other lost slots
    FAIL = "fail"  # stop the job with ``reason``


@dataclass(frozen=True)
class WidthSituation:
    """What the coordinator knows when a round has slots to fill."""

    width: int  # the job's slots (--nproc): its full data-parallel width
    survivors: int  # live processes that hold slots and stay in the job
    needed: int  # slots whose process is lost in this round
    ready: int  # ready spares that can take one of them
    starting: int  # spares on their way to one of them
    waited: float  # seconds this round has waited for spares so far
    wait_limit: float  # --spare-wait
    policy: NoSparePolicy = NoSparePolicy.FAIL
    min_replicas: int = 1  # --min-replicas: fewer live processes than this is a failure
    # why the job cannot go on degraded (a sharded mesh, a lost shard with no copy); "" when it can
    not_shrinkable: str = ""


@dataclass(frozen=True)
class WidthDecision:
    action: WidthAction
    spawn: int = 0  # new spare processes to start now
    reason: str = ""
    width_after: int = 0  # live processes holding slots once the decision is applied


def width_decision(s: WidthSituation) -> WidthDecision:
    """Assign, wait, shrink or fail (module docstring); never wait without a deadline.

    Ready spares are always used at once. The missing ones are always started, under every
    policy: with ``shrink`` they grow the job back once ready. Going on degraded needs at least
    ``min_replicas`` live processes after the ready spares are assigned; below that, or when the
    job cannot shrink at all, the round waits up to ``wait_limit`` and then fails with the
    reason, whatever the policy.
    """
    if s.ready >= s.needed:
        return WidthDecision(WidthAction.ASSIGN, width_after=s.survivors + s.needed)
    spawn = max(0, s.needed - s.ready - s.starting)
    after = s.survivors + s.ready
    can_shrink = not s.not_shrinkable and after >= max(1, s.min_replicas)
    if s.policy == NoSparePolicy.SHRINK and can_shrink:
        return WidthDecision(WidthAction.SHRINK, spawn, _shrink_reason(s, after), after)
    if s.waited < s.wait_limit:
        return WidthDecision(
            WidthAction.WAIT,
            spawn,
            f"waiting for {s.needed - s.ready} spare(s) to start",
            s.survivors + s.needed,
        )
    if s.policy == NoSparePolicy.WAIT and can_shrink:
        return WidthDecision(WidthAction.SHRINK, spawn, _shrink_reason(s, after), after)
    return WidthDecision(WidthAction.FAIL, reason=_fail_reason(s, after), width_after=after)


def _shrink_reason(s: WidthSituation, after: int) -> str:
    return (
        f"no spare ready for {s.needed - s.ready} slot(s): going on with {after} of {s.width} "
        f"replicas (--when-no-spare {s.policy.value}); the survivors train the missing slots' "
        "batches until a spare takes them back"
    )


def _fail_reason(s: WidthSituation, after: int) -> str:
    base = (
        f"{s.needed} rank(s) need a replacement but only {s.ready} spare(s) were ready after "
        f"waiting {s.waited:.0f} s"
    )
    if s.policy == NoSparePolicy.FAIL:
        return (
            f"{base}; keep more hot spares with --spares, allow longer with --spare-wait, or go on "
            "with fewer replicas meanwhile with --when-no-spare wait"
        )
    if s.not_shrinkable:
        return f"{base}, and the job cannot go on with fewer replicas: {s.not_shrinkable}"
    return (
        f"{base}, and going on would leave {after} of {s.width} replicas, fewer than "
        f"--min-replicas {s.min_replicas}; keep more hot spares with --spares, allow longer "
        "with --spare-wait or lower --min-replicas"
    )


def assign_slots(holders: Mapping[int, Sequence[int]], lost: Sequence[int]) -> dict[int, list[int]]:
    """Give every slot in ``lost`` to a survivor: ``holders`` maps each live process (by its
    primary slot, the rank it was started or assigned as) to the slots it holds now.

    Each lost slot, lowest first, goes to the process holding the fewest slots (the lowest
    process on a tie), so the extra passes spread as evenly as they can: the step time of a
    degraded job is set by its most loaded process. A lost process's own extra slots are in
    ``lost`` too. Returns the new holders, every slot list sorted."""
    if not holders:
        raise ValueError("assign_slots: no live process to hold the lost slots")
    out = {p: sorted(slots) for p, slots in holders.items()}
    held = {slot for slots in out.values() for slot in slots}
    for slot in sorted(set(lost)):
        if slot in held:
            raise ValueError(f"assign_slots: slot {slot} is both lost and held")
        p = min(out, key=lambda q: (len(out[q]), q))
        out[p] = sorted([*out[p], slot])
    return out


def slots_to_grow(holders: Mapping[int, Sequence[int]], ready: int) -> list[int]:
    """The slots that ``ready`` spares take back at the next step boundary, sorted.

    ``holders`` as for :func:`assign_slots`: a process keeps its own slot (its key) and gives
    back only held-over ones. One at a time, the most loaded process gives up its highest extra
    slot (the lowest process on a tie), so each spare shortens the degraded step the most."""
    extra = {p: sorted(s for s in slots if s != p) for p, slots in holders.items()}
    back: list[int] = []
    for _ in range(max(0, ready)):
        p = min(extra, key=lambda q: (-len(extra[q]), q), default=None)
        if p is None or not extra[p]:
            break
        back.append(extra[p].pop())
    return sorted(back)


def ideal_step_time(full_step_s: float, width: int, holders: Mapping[int, Sequence[int]]) -> float:
    """The step time a degraded job should reach: its most loaded process runs one pass per slot
    it holds (``width / live`` times the full step time when the slots spread evenly)."""
    if width < 1 or not holders:
        raise ValueError("ideal_step_time: needs slots and live processes")
    return full_step_s * max(len(s) for s in holders.values())


def fold_held_slots(plan: RecoveryPlan, held: Mapping[int, int]) -> RecoveryPlan:
    """``plan`` with each held slot's part given to its holder (``held``: slot -> holder).

    A held slot reports its holder's state (its replica is the holder's own), so the plan rule
    makes it a receiver whenever its holder is one, and may pick it as the source. But a
    process receives and sends once, as its own rank: a sender that also streamed to the held
    slot waited for a receiver that never came (seen: the holder one step behind when the slot
    was lost, every member stuck in the state transfer), and a held slot chosen as the source
    would have no process sending for it. So a held slot is never a receiver (its holder's
    receipt is its state), and a held source is its holder."""
    if not held:
        return plan

    def sender(rank: int) -> int:
        return held.get(rank, rank)

    return with_fields(
        plan,
        source=sender(plan.source) if plan.source >= 0 else plan.source,
        receivers=tuple(r for r in plan.receivers if r not in held),
        sources=tuple((r, sender(s)) for r, s in plan.sources if r not in held),
        from_copy=tuple(r for r in plan.from_copy if r not in held),
        own_snapshot=tuple(r for r in plan.own_snapshot if r not in held),
    )
