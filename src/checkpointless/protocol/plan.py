"""The plan of a recovery round, as every member receives it in its ``Recover``.

The coordinator's rule (``coordinator/rules/decisions.py``) decides where training resumes and
who sends state to whom; :class:`ResumePlan` is that decision on the wire, a record nested in
:class:`~checkpointless.protocol.worker_link.Recover`. Its per-rank lists travel compact once
they are long (``peer_table.compact_plan``: ranges and runs, so a plan's size does not grow with
the job); the codec (:mod:`~checkpointless.protocol.codec`) compacts and expands them, and checks
every field on arrival, so the worker reads typed fields, never a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PLAN_FIELDS_ALWAYS_SENT", "ResumePlan"]

# what every plan on the wire carries; the other fields travel only when set (as they always did)
PLAN_FIELDS_ALWAYS_SENT = frozenset({"target_step", "source", "receivers"})


@dataclass(frozen=True)
class ResumePlan:
    """Where every rank resumes, and where each receiver's state comes from."""

    target_step: int  # every rank resumes by running this step
    source: int = -1  # the rank that sends state; -1 when it comes from a snapshot or checkpoint
    receivers: list[int] = field(default_factory=list)  # ranks that take another's state
    # (receiver, source) pairs when receivers take state from different ranks (a sharded mesh:
    # each from a holder of its own shard); empty: every receiver takes ``source``'s state
    sources: list[list[int]] = field(default_factory=list)
    from_copy: list[int] = field(default_factory=list)  # receivers sent the buddy copy kept for them
    own_snapshot: list[int] = field(default_factory=list)  # receivers that load their own snapshot
    from_snapshot: bool = False  # every rank loads the shared-memory snapshot of target_step
    from_checkpoint: bool = False  # every rank loads the durable checkpoint of target_step
    # degraded mode (docs/fault-model.md): [slot, holder] pairs for every data-parallel slot that
    # a live process other than its own holds (it trains that slot's micro-batch as an extra pass
    # of each step, and is that slot's rank in its groups); empty at full width
    holders: list[list[int]] = field(default_factory=list)
    # the protected sections that completed at the boundary after ``target_step`` steps: some
    # rank passed their closing barrier, so every rank takes them as done and none redoes them
    # (coordinator/rules/sections.py)
    sections_closed: list[str] = field(default_factory=list)

    def held_by(self) -> dict[int, int]:
        """slot -> the rank whose process holds it, for every held-over slot (empty at full width)."""
        return {slot: holder for slot, holder in self.holders}

    def slots_of(self, rank: int) -> list[int]:
        """The slots ``rank``'s process trains each step, in pass order: its own and those it holds."""
        return sorted([rank, *(slot for slot, holder in self.holders if holder == rank)])

    def source_of(self) -> dict[int, int]:
        """receiver -> the rank it takes state from: per-receiver pairs when present (a sharded
        mesh), else one source for every receiver; empty for snapshot and checkpoint plans."""
        if self.from_snapshot or self.from_checkpoint:
            return {}
        if self.sources or self.own_snapshot:
            return {r: s for r, s in self.sources}
        return {r: self.source for r in self.receivers}
