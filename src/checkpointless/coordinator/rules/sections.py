"""Whether a protected section completed, as every rank of the next generation is to take it.

A section ends with a closing barrier (recovery/driver.py, ``close_section``). A rank that has
passed it takes the section as complete: it shows what the section held and goes on into the
next step. An abort that lands as that barrier completes can leave a live peer failing it: a
barrier aborted in flight is given 1 s more to complete (``Communicator.barrier``), and one whose
last part has not reached it by then (its host too loaded to read it, a resent packet) raises,
though its peers have passed. Left to its own view, that rank would leave the recovery at the
same step as its peers with the section due, they with it done: it would run the section's
collectives against their step's, and the section's work and lines would come twice.

A rank passes the barrier only once every rank has entered it, every rank's work in the section
done, so one pass anywhere settles it: the section is complete on every rank. Unit-tested in
tests/unit/coordinator/test_sections_rule.py.

What no report can settle: a rank lost in or just past the closing barrier while every live
rank's barrier failed (a SIGKILL between the barrier's completion and its mark; its host lost
before its keeper one host over heard of the pass within the keeper's wait; the keeper lost too).
Nobody live passed, so the section is redone on every rank, as it must be for the ranks to agree;
but if the lost rank did pass, what it did past the barrier (its ``section`` event, lines it
showed) may come twice. Its replacement or its keeper
says that it entered and nobody can say more (``sections_entered``), and ``doubtful_sections``
names such a section, for the launcher to report as an ``Inexact`` resume rather than redo it
silently. A rank lost with its host whose keeper is gone too (both hosts lost, or the keeper a
replacement that keeps nothing of its owners yet) leaves nobody to say even that: it is
*unheard* (``unheard_ranks``), and a section every live rank entered and failed is doubtful for
it as well, since nothing rules its pass out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from checkpointless.coordinator.rules.decisions import MemberReport

__all__ = ["closed_sections", "doubtful_sections", "unheard_ranks"]


def closed_sections(reports: Iterable[MemberReport], target_step: int) -> tuple[str, ...]:
    """The sections that completed at the boundary after ``target_step`` steps, sorted: each one
    some member passed the closing barrier of there. A valid member says so of the boundary it
    stopped at; a replacement of the boundary its predecessor passed it at (``sections_step``,
    marked on its host just after the barrier), which counts only where the job resumes at a
    live replica's step (not when it goes back to a snapshot or a checkpoint, whose state has
    the sections as they were saved). A report about another boundary (a rank behind the
    target receives its state) or from another invalid member (a rank cut off in its update)
    says nothing about this one."""
    reports = list(reports)
    if not any(r.valid and r.committed_step == target_step for r in reports):
        return ()
    done: set[str] = set()
    for report in reports:
        at = report.committed_step if report.sections_step is None else report.sections_step
        if at == target_step and (report.valid or report.sections_step is not None):
            done.update(report.sections_closed)
    return tuple(sorted(done))


def unheard_ranks(
    lost_with_host: Iterable[int], reports: Iterable[MemberReport], keeper_of: Callable[[int], int | None]
) -> tuple[int, ...]:
    """The ranks of ``lost_with_host`` (their pass marks went with their host's memory) whose
    keeper (``keeper_of``: the rank one host over that their records ride to) sent no report as
    a process that ran the job: a replacement's report speaks for its own predecessor only, and
    a keeper lost too says nothing of its owners. Sorted."""
    speakers = {r.rank for r in reports if r.committed_step >= 0}
    return tuple(sorted({rank for rank in lost_with_host if keeper_of(rank) not in speakers}))


def doubtful_sections(
    reports: Iterable[MemberReport],
    target_step: int,
    closed: Iterable[str] = (),
    unheard: Iterable[int] = (),
) -> dict[str, tuple[int, ...]]:
    """The sections redone at the boundary after ``target_step`` steps that a lost rank may have
    passed, each with those ranks (sorted): a member said the rank entered the closing barrier
    there and nobody can say whether it passed (``sections_entered``, counted as
    ``sections_closed`` is), no member passed it (``closed``: those are not redone), and every
    valid member at the target entered it too and failed it (``sections_left``): a barrier
    passes only once every rank has entered it, so a live rank that never reached it (a fault
    in the section's work) rules the pass out. Each such section is doubtful for the
    ``unheard`` ranks too (:func:`unheard_ranks`): nobody can say whether they entered it."""
    reports = list(reports)
    live = [r for r in reports if r.valid and r.committed_step == target_step]
    if not live:
        return {}
    done, doubt = set(closed), dict[str, set[int]]()
    for report in reports:
        at = report.committed_step if report.sections_step is None else report.sections_step
        if at != target_step or not (report.valid or report.sections_step is not None):
            continue
        for name, ranks in report.sections_entered:
            if name not in done and all(name in r.sections_left for r in live):
                doubt.setdefault(name, set()).update(ranks)
    left_by_all = set.intersection(*(set(r.sections_left) for r in live)) - done
    for name in left_by_all if unheard else ():
        doubt.setdefault(name, set()).update(unheard)
    return {name: tuple(sorted(ranks)) for name, ranks in sorted(doubt.items())}
