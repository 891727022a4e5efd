"""The step loop behind ``job.steps()``: start (or join) the job's state, yield steps until every
rank has committed the total, run the sections due between steps, and leave together.

Functions of the :class:`~checkpointless.recovery.member.Member` they drive, below the public API
in ``job.py`` (as recover.py keeps the recovery round and startup.py the joining). A step's own
commit and fault handling are in step.py and commit.py.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator

from checkpointless.errors import CommAborted, ConfigError
from checkpointless.events import get_logger
from checkpointless.protocol import Done
from checkpointless.recovery.first_generation import finish_opening
from checkpointless.recovery.held_lines import HeldLinesFile
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.loop import LOOP_STATE_NAME
from checkpointless.recovery.member import Member
from checkpointless.recovery.process import close_at_exit, install_fast_exit, short_error
from checkpointless.recovery.recover import recover, recover_from
from checkpointless.recovery.section_closing import carry_end, carry_left, carry_pass, carry_shown
from checkpointless.recovery.section_pass import pass_mark
from checkpointless.recovery.sections import Section, due_sections
from checkpointless.recovery.step import Step
from checkpointless.recovery.torchrun import start_from_first_replica
from checkpointless.state.snapshot import RngState, capture_rng, restore_rng

__all__ = ["close_section", "run_steps"]

log = get_logger()


def run_steps(member: Member, total: int, start: int, steps_per_epoch: int | None) -> Iterator[Step]:
    """The generator behind :meth:`Job.steps` (its docstring says what it yields)."""
    if member.clock.started:
        raise ConfigError("job.steps() can run only once per process")
    if not 0 <= start <= total:
        raise ConfigError(f"job.steps(total={total}, start={start}): start must be in 0..total")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ConfigError(f"steps_per_epoch must be a positive number of steps (got {steps_per_epoch})")
    member.schedule.steps_per_epoch = steps_per_epoch
    member.clock.started = True
    member.committed_step = start
    if member.under_torchrun:  # what the launcher's first round does: the first replica's state
        shards = member.groups.shards
        member.committed_step = start_from_first_replica(
            member.comm,
            member.tracked.objects,
            start,
            member.rank,
            member.world_size,
            member.rendezvous_timeout,
            shards,
        )
    if member.recovery.connected and not member.tracked.objects:
        member.recovery.fatal(
            "job.track() registered nothing: a replacement rank would start from scratch and "
            "diverge; call job.track(model=..., optimizer=...) before job.steps()",
        )
    if member.recovery.connected:
        member.tracked.objects[LOOP_STATE_NAME] = member.loop  # an early end travels to a replacement
        if member.is_replacement:
            recover(member, cause="join", error=None, committed=-1, valid=False)
            _show_predecessors_lines(member)
        elif member.opening is not None:  # its groups formed in init(): the state sync is left
            finish_opening(member, start)
        else:
            recover(member, cause="start", error=None, committed=start, valid=True)
    step: Step | None = None
    try:
        while _run_sections(member) or not _finished(member, total):
            # degraded mode: one pass per slot this process holds (recovery/slots.py), the
            # update in the last; a pass that failed starts the step (or the next) over
            slots = member.groups.held.passes(member.rank)
            for loader in member.tracked.loaders:  # the readers of slots a spare took back stop
                if isinstance(loader, StepLoader):
                    loader.release_slots(slots)
            member.held_rng.release(slots)  # ... and their generators are the spare's
            for i, slot in enumerate(slots):
                step = Step(member, member.committed_step, slot=slot, pass_index=i, passes=len(slots))
                # job.rank is the held slot until the next pass is yielded (recovery/held_pass.py)
                member.held_pass.begin(step.index, None if slot == member.rank else slot, i, len(slots))
                try:
                    yield step
                finally:
                    member.held_pass.end()
                if not step.entered:
                    # Without `with step:` nothing commits, so the loop would yield the same step
                    # for ever, and a recovery could neither stop nor replay the body: say so
                    # instead of training on outside the job.
                    member.recovery.fatal(
                        f"the body of `for step in job.steps(...)` ran outside `with step:` (step "
                        f"{step.index}); put the step's work inside it: "
                        "`for step in job.steps(N):` then `with step:` around forward, backward and "
                        "the optimizer step",
                    )
                if not step.passed:
                    break
    except GeneratorExit:  # the script left the loop with `break`
        if step is None or not step.committed:  # an error escaping the loop, not a clean end
            log.warning("left job.steps() in a step that did not commit: not a clean end")
            return
        member.loop.request_stop(member.committed_step)
        while member.recovery.connected and not _finish_barrier(member):
            pass
    if member.recovery.connected:
        # first: from here on this rank makes no step progress, and must not be judged by it
        # while the last checkpoint finishes or the script's own code runs after the loop
        member.recovery.send(Done(step=member.committed_step))
    for loader in member.tracked.loaders:
        loader.close()
    member.replicas.finish(member.rendezvous_timeout)
    if member.recovery.link is not None:
        install_fast_exit()
        # registered after it, so it runs before the exit: the coordinator must see we finished
        atexit.register(member.recovery.link.await_release)
    else:  # torchrun or standalone: the process exits normally, its groups closed first
        close_at_exit(member.groups.close, member.rendezvous_timeout)


def _run_sections(member: Member) -> bool:
    """Run the sections due at this step boundary until each completes; always False (so it
    can sit in the loop's condition)."""
    while due := due_sections(member.schedule.sections, member.committed_step, member.loop.sections_done):
        sec, at = due[0], member.committed_step
        # The generators as the section begins: a fault inside it redoes the section from them
        # (resume_rng, also what a replacement receives). The first attempt has drawn from them
        # already, and an evaluation that samples, or dropout left on, would otherwise leave
        # every later step with other random numbers than the run without the fault.
        member.record.begin_section(at)
        member.replicas.rank_rng.keep(at, member.record.rng_for(at), sec.name)  # for a replacement
        member.clock.in_section = sec.name  # no step-progress clock inside (an evaluation may be long)
        after: RngState | None = None
        try:
            sec.fn()
            # the section's work is done: a "section" fault fires here (faults/inject.py)
            member.guard.injector.maybe_fire("section", at)
            # ... and where this rank's generators stand now is where a replacement resumes if
            # its peers pass the closing barrier and this rank is lost before (or as) it does:
            # kept before the barrier, since its peers may pass it before it returns here
            after = capture_rng()
            member.replicas.rank_rng.keep_section_end(at, after, sec.name)
            held = sec.held.encode() if sec.held is not None else None
            if held is not None:  # ... and what it holds to show as it closes
                _held_file(member).keep(at, sec.name, held)
            carry_end(member, at, sec.name, after, held)  # ... also to its keeper one host over
            # entered, not yet passed: a replacement finding only this says so (section_pass.py)
            pass_mark(member).mark(at, sec.name, passed=False)
            close_section(member)
            # the barrier completed here, and this rank fails it anyway: an "unsettled" fault
            # fires here, as an abort that landed before it completed here would have
            member.guard.injector.maybe_fire("unsettled", at)
        except Exception as exc:
            if not member.recovery.connected or isinstance(exc, ConfigError):
                raise  # no launcher, or an error a replay would raise again (run_script.py)
            member.clock.in_section = None
            if after is not None:  # its keeper may wait to learn whether it passed: it did not
                carry_left(member, at, sec.name)
            log.info("section %r after step %d interrupted: %s", sec.name, at - 1, short_error(exc))
            recover_from(member, at, exc)  # nothing was updated: every survivor stays valid
            if not _closed_by_peers(member, sec, at):
                continue  # no rank passed the closing barrier: every rank redoes the section
            if after is None:  # not seen: a peer passes only once this rank's work is done
                log.warning("section %r at step %d closed with no generators kept at its end", sec.name, at)
                after = capture_rng()
            restore_rng(after)  # the recovery resumed them as the section began
        finally:
            member.clock.in_section = None
        # The barrier completed here: every rank has done all of the section's work, and a peer
        # may be in the next step already. The section is complete from now on, whatever
        # happens next on this rank: a fault after this point never redoes it (its peers could
        # not redo it with this rank), and one here is recovered like a fault at the start of
        # the next step, from the generators as the section left them.
        member.loop.sections_done[sec.name] = at
        pass_mark(member).mark(at, sec.name)  # its replacement says so, should it be lost now
        carry_pass(member, at, sec.name)  # ... and its keeper one host over, should its host be
        member.record.end_section(at, after)
        member.record.emit("section", name=sec.name, step=at, generation=member.generation)
        member.record.fields = {}
        member.clock.restart()
        _after_section(member, sec, at)
    return False


def _closed_by_peers(member: Member, sec: Section, at: int) -> bool:
    """After a recovery from a fault in section ``sec`` at the boundary after ``at`` steps:
    whether a peer passed its closing barrier (the plan says so: coordinator/rules/sections.py),
    though this rank's failed. Then the section is complete here too, and it is ended as if this
    rank had passed: from the generators as its work left them (``after``, taken before the
    barrier), what it held shown once by ``closed``. Redoing it would run its collectives
    against its peers' next step."""
    if member.committed_step != at or member.loop.sections_done.get(sec.name) != at:
        return False
    log.info(
        "section %r at step %d: a peer passed its closing barrier, which failed here; it is "
        "complete on every rank and not redone",
        sec.name,
        at,
    )
    return True


def _after_section(member: Member, sec: Section, at: int) -> None:
    """What follows a section once it has closed on every rank (its ``closed``: the lines an
    integration held, a tracker's record), recovered in process if it raises: its peers are
    past the section, so it is not redone; the recovery keeps every rank at this boundary,
    and ``closed`` is called again to finish what it left (it must resume, not restart: an
    integration's held lines are shown once). A ``closed`` that keeps raising ends the job as
    a step that keeps raising does (``max_step_retries``)."""
    while True:
        try:
            # this rank has passed the closing barrier, its peer maybe not yet: a "closed"
            # fault fires here (faults/inject.py)
            member.guard.injector.maybe_fire("closed", at)
            if sec.closed is not None:
                sec.closed()
            if sec.held is not None:
                _held_file(member).drop()  # shown: a replacement must not show it again
                carry_shown(member, at, sec.name)  # ... here nor on another host
            return
        except Exception as exc:
            if not member.recovery.connected or isinstance(exc, ConfigError):
                raise
            log.info("after section %r closed at step %d: %s", sec.name, at, short_error(exc))
            recover_from(member, at, exc)  # nothing was updated: every survivor stays valid
            if member.committed_step != at or member.loop.sections_done.get(sec.name) != at:
                return  # the job went back to an older state (every replica lost): not shown
            member.record.end_section(at, capture_rng())


def _held_file(member: Member) -> HeldLinesFile:
    keeper = member.replicas.rank_rng  # beside this rank's generator records
    return HeldLinesFile(keeper.directory, keeper.rank)


def _show_predecessors_lines(member: Member) -> None:
    """A replacement that joined at a boundary whose section its predecessor completed (its
    peers passed the closing barrier) and whose held lines it did not show: show them now, once
    (held_lines.py), as its ``closed`` would have."""
    at = member.committed_step
    for sec in member.schedule.sections:
        if sec.held is None or member.loop.sections_done.get(sec.name) != at:
            continue
        lines = _held_file(member).load(at, sec.name)
        if lines is None:
            continue
        log.info(
            "showing the lines rank %d held in section %r at step %d before it was lost",
            member.rank,
            sec.name,
            at,
        )
        sec.held.restore(lines)
        _after_section(member, sec, at)


def close_section(member: Member) -> None:
    """Leave the section on every rank together: none completes it (and goes on to the next
    step) before every rank has done all of its work.

    A rank failing after the section's last collective (in the checkpoint it saves after the
    evaluation's gathers, say) would otherwise find its peers gone on into the next step while it
    redoes the section alone, its gathers meeting their gradient all-reduce: a stall the launcher
    ends as 'faults keep recurring'. Here its peers wait instead, are interrupted with it, and
    every rank redoes the section from its start, so what the loop is given from the section,
    and the ``section`` event, come once. The barrier's settling (``Communicator.barrier``)
    keeps a rank from failing it once a peer has passed it. Without a launcher nothing is
    redone, and nothing waits here.

    The barrier sets no time limit of its own, as the section's work has none: a lost or
    stopped peer is the launcher's to detect (it aborts the barrier), and no step-progress limit
    runs inside a section (recovery/clock.py). The process group's own timeout
    (``init(rendezvous_timeout=...)``) still ends a barrier that waits longer, as it ends any
    collective: one rank's own work after its peers finished the section (a save on rank 0)
    must fit in it.
    """
    if member.recovery.connected:
        member.groups.held.barrier(member.comm, None)  # every slot this process holds, too


def _finished(member: Member, total: int) -> bool:
    while member.committed_step >= member.loop.end(total):
        if not member.recovery.connected or _finish_barrier(member):
            return True
        # The barrier was interrupted and a recovery ran. Unless it rolled the job back (then
        # steps remain), every rank is at the end again and meets in the barrier once more: a
        # rank that ran a step here instead met its peers' barrier with a gradient all-reduce
        # (gloo aborts the process on the size mismatch; seen in a soak run).
    return False


def _finish_barrier(member: Member) -> bool:
    # Nobody leaves before everyone has the final state: a rank that left early could be
    # the only source a late replacement could receive from.
    try:
        # the final barrier is an "allreduce" site of step N, N the job's length (faults/inject.py)
        member.guard.injector.maybe_fire("allreduce", member.committed_step)
        member.groups.held.barrier(member.comm, member.rendezvous_timeout)  # every slot held
        return True
    except CommAborted as e:
        log.info("final barrier interrupted: %s", short_error(e))
        member.comm.abort(f"rank {member.rank} left the final barrier")
        recover(member, "comm", short_error(e), member.committed_step, True)
        return False
