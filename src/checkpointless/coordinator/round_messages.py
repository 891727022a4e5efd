"""The messages of a recovery round, built from the job's settings, a member's report and the
rule's plan: pure functions, so that what travels is read in one place and ``rounds.py`` keeps
the round's decisions.

``Assign`` gives a process its rank, ``Stopped`` becomes the rule's :class:`MemberReport`, and the
rule's :class:`RecoveryPlan` goes out in every member's ``Recover`` as a :class:`ResumePlan`,
with the peer table's version and delta (``tables.py``).
"""

from __future__ import annotations

from typing import Any

from checkpointless.coordinator.rules.decisions import MemberReport, RecoveryPlan
from checkpointless.coordinator.rules.placement import placement
from checkpointless.coordinator.tables import PlanTable
from checkpointless.protocol import Assign, Recover, ResumePlan, Stopped
from checkpointless.settings import JobSettings as LaunchConfig

__all__ = ["assign_message", "member_report", "recover_message", "resume_plan"]


def assign_message(
    cfg: LaunchConfig, rank: int, generation: int, fired: list[str], checkpoint_dir: str, initial: bool
) -> Assign:
    """A process's rank, where it sits on its node, and the job's settings a worker needs."""
    where = placement(rank, cfg.per_node)
    return Assign(
        rank=rank,
        world_size=cfg.nproc,
        generation=generation,
        faults=list(cfg.faults),
        fired=fired,
        snapshot_every=cfg.snapshot_every,
        checkpoint_every=str(cfg.checkpoint_every),
        checkpoint_dir=checkpoint_dir,
        local_rank=where.local_rank,
        local_world_size=where.local_world_size,
        node_rank=where.node_rank,
        divergence_check=cfg.divergence_check,
        buddy_copies=cfg.buddy_copies,
        buddy_every=cfg.buddy_every,
        initial=initial,
    )


def member_report(rank: int, msg: Stopped) -> MemberReport:
    """What ``rank`` said where it stopped, as the recovery rule reads it."""
    return MemberReport(
        rank,
        msg.committed_step,
        msg.valid,
        msg.snapshot_step,
        msg.checkpoint_step,
        checkpoint_steps=tuple(msg.checkpoint_steps),
        mesh=(msg.mesh[0], msg.mesh[1]) if msg.mesh and len(msg.mesh) == 2 else None,
        copies=tuple((c[0], c[1]) for c in msg.copies if len(c) == 2),
        own_snapshots=tuple(msg.own_snapshots),
        sections_closed=tuple(msg.sections_closed),
        sections_step=msg.sections_step,
        sections_entered=tuple(
            (name, tuple(r for r in ranks if type(r) is int))
            for name, ranks in sorted(msg.sections_entered.items())
            if isinstance(ranks, list)
        ),
        sections_left=tuple(msg.sections_left),
    )


def resume_plan(plan: RecoveryPlan, holders: list[list[int]] | None = None) -> ResumePlan:
    """The rule's plan as every member receives it (``Recover.plan``), with the held slots."""
    return ResumePlan(
        target_step=plan.target_step,
        source=plan.source,
        receivers=list(plan.receivers),
        sources=[list(pair) for pair in plan.sources],
        from_copy=list(plan.from_copy),
        own_snapshot=list(plan.own_snapshot),
        from_snapshot=plan.from_snapshot,
        from_checkpoint=plan.from_checkpoint,
        holders=list(holders or []),
    )


def recover_message(generation: int, rendezvous: dict[str, Any], plan: ResumePlan, t: PlanTable) -> Recover:
    """The one ``Recover`` every member of ``generation`` gets, of a size that does not grow
    with the job: the plan, the rendezvous, and the peer table's version and delta (``t``)."""
    return Recover(
        generation=generation,
        rendezvous=dict(rendezvous),
        plan=plan,
        table_version=t.version,
        table_base=t.base,
        table_digest=t.digest,
        moved_ranks=t.moved_ranks,
        moved_to=t.moved_to,
    )
