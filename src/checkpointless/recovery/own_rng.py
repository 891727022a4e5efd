"""Which generators (and loader positions) a rank resumes with after a recovery round.

Random generators are per-rank state: a script may seed them per rank and draw per rank, so a
rank resumes with its own, never a peer's whose state it received. Its own are the ones it had
when the step began, the record it kept of them (recovery/rank_rng.py, on this host or with its
keeper on another: rank_rng_peer.py), or, failing both, what was sent, which is then reported
as an inexact resume (never silent). The round itself (recover.py) calls these once the state
it resumes from is in place.
"""

from __future__ import annotations

from checkpointless.events import get_logger
from checkpointless.protocol import Inexact
from checkpointless.recovery.member import Member
from checkpointless.recovery.rank_rng import RngRecord
from checkpointless.recovery.section_closing import adopt
from checkpointless.state.snapshot import RngState, restore_rng
from checkpointless.state.transfer import StreamRoute

__all__ = ["kept_record", "receiver_rng", "report_inexact", "restore_kept_rng", "resume_rng"]

log = get_logger()


def resume_rng(member: Member, target: int) -> RngState:
    """This rank's generators as they stood when step ``target`` first began here
    (``StepRecord.rng_for``), or as it kept them for ``target`` (the commit of step ``target - 1``,
    recovery/rank_rng.py); failing both, as they are now (it rolled a step forward it updated)."""
    at_start = member.record.rng_at_start
    if at_start is not None and at_start[0] == target:
        return at_start[1]
    kept = member.replicas.rank_rng.load(target)
    return kept.rng if kept is not None else member.record.rng_for(target)


def kept_record(member: Member, target: int, route: StreamRoute | None) -> RngRecord | None:
    """This rank's record of step ``target``: kept on this host (by this process, or by its
    predecessor in shared memory), else, for a replacement, by its rank's keeper on another
    host (recovery/rank_rng_peer.py: its predecessor's host may be lost)."""
    kept = member.replicas.rank_rng.load(target)
    if kept is not None or route is None or not member.is_replacement or member.replicas.rank_rng.began:
        return kept
    fetched = member.replicas.rank_rng_peer.fetch(route, target, min(member.rendezvous_timeout, 10.0))
    if fetched is not None:
        # how its section closed there, if it did: into this host's files, where the step loop
        # looks for the section's end generators and held lines (section_closing.py)
        left_behind = adopt(member, fetched)
        if left_behind is not None:
            report_inexact(member, target, "lines", left_behind)
    return fetched


def report_inexact(member: Member, step: int, what: str, detail: str) -> None:
    """Resumed without some of this rank's own state: said in its log, and to the coordinator,
    whose ``inexact`` event and ``job_end`` account carry it (never silent)."""
    log.warning("%s", detail)
    if member.recovery.link is not None:
        member.recovery.send(Inexact(step=step, what=what, detail=detail))


def restore_kept_rng(member: Member, target: int, route: StreamRoute | None = None) -> None:
    """After a restore of rank 0's snapshot or checkpoint (every replica lost): this rank's own
    generators where it (or its predecessor) kept a record of ``target``; otherwise the
    snapshot's stand (a record of that step is rarely still kept: two steps are)."""
    kept = kept_record(member, target, route)
    if kept is not None:
        restore_rng(kept.rng)
        member.tracked.positions.restore(kept.data, target)  # its own loader positions (rank_data.py)


def receiver_rng(
    member: Member, target: int, sent: RngState, from_copy: bool, route: StreamRoute | None = None
) -> RngState:
    """The generators a rank that received its replica's state resumes with: its own, never the
    sender's (they are per-rank state: a script may seed them per rank, and draw per rank).

    A rank that has run steps in this process has them (``resume_rng``). A replacement takes
    the record its predecessor kept for ``target`` (recovery/rank_rng.py), on this host or with
    its rank's keeper on another (``kept_record``). Without one it keeps what was sent: a buddy
    copy's are its owner's own; a replica peer's are the peer's, and then the run may differ
    from the run without the fault, which is reported (``report_inexact``).

    The record's loader positions (recovery/rank_data.py) are loaded over the received ones the
    same way: this rank's own, never the sender's, where a record of ``target`` holds them."""
    keeper = member.replicas.rank_rng
    if not member.is_replacement or keeper.began:
        own = keeper.load(target)
        member.tracked.positions.restore(own.data if own is not None else None, target)
        return resume_rng(member, target)
    kept = kept_record(member, target, route)
    if kept is not None:
        member.tracked.positions.restore(kept.data, target)
        if kept.section is not None and member.loop.sections_done.get(kept.section) == target:
            # lost in the section after all its work, its peers past the closing barrier: the
            # generators as the section left them, kept before that barrier
            end = keeper.load_section_end(target, kept.section)
            if end is not None:
                return end.rng
            report_inexact(
                member,
                target,
                "rng",
                f"rank {member.rank} was lost inside section {kept.section!r} after step {target - 1}, "
                "which its peers completed: its replacement does not run it again, so what it drew "
                "there is lost (the run may differ from the run without the fault)",
            )
        return kept.rng
    if not from_copy:
        report_inexact(
            member,
            target,
            "rng",
            f"no record of rank {member.rank}'s own generators for step {target} on this host or "
            "with its keeper on another: resuming the sender's (a script that draws per-rank random "
            "numbers from the global generators may now differ from the run without the fault; "
            "docs/fault-model.md, docs/adoption.md)",
        )
    return sent
