"""The job's first generation under the launcher: its groups formed in ``init()``, its state
synchronised in ``job.steps()``.

Scripts and frameworks communicate before their training loop: Lightning's ``prepare_data``
barrier, ``parallelize_module`` and ``distribute_tensor`` scattering each shard from tp rank 0,
a broadcast of the initial weights, a plain ``dist.barrier()``. So the groups must have their
communicators from ``init()`` on, while the job's first state sync (every rank takes the state of
its shard's holder in the first replica group, as DDP's broadcast at construction) can only run
once ``job.track()`` has said what the state is, in ``job.steps()``. The launcher's first round
is therefore split in two:

* :func:`open_first_generation`, in ``init()``: this rank reports to the start-up round, and
  once the plan arrives it forms the generation's groups (the data-parallel communicator and
  torch's default group; a mesh or a ``dist.new_group`` made later forms at once from the same
  store, :class:`Opening`). Nothing is sent to the launcher yet: to it the round is still
  forming, so a fault meanwhile is a start-up fault.
* :func:`finish_opening`, in ``job.steps()``: the state sync over the formed groups (the first
  replica's shards to the others, ``start_from_first_replica``), then ``Recovered``, then a
  barrier, so that no rank trains before every rank holds the job's first state.

A fault in between (a rank lost inside a collective before the loop, or in the sync) has no step
to replay, and the launcher answers it as it answers any fault during start-up: a spare takes the
lost rank and runs the script from the top, not as a replacement. The survivors cannot go back
to the top of their own scripts, so what happens to each depends on what it has done:

* a rank that has communicated through torch.distributed since its groups formed (a collective
  on any group, or a group of its own made with ``dist.new_group``) ends its process
  (:data:`START_OVER_EXIT`) and a spare runs its script from the top too: the lost rank's
  replacement will issue the same collectives from the first one, and nobody else could meet it
  there. Nothing had trained yet, so nothing is lost but the start-up time;
* a rank that has not (the usual data-parallel or FSDP script: ``job.device_mesh()`` and
  ``fully_shard`` communicate nothing) stays: in ``job.steps()`` it reports to the next start-up
  round like a new rank and forms the new generation with the spare, then syncs the state again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NoReturn

from checkpointless.comm.script_groups import GroupsDisagree
from checkpointless.events import get_logger
from checkpointless.protocol import Abort, Recover, Recovered, Stopped
from checkpointless.recovery.member import Member, Opening
from checkpointless.recovery.process import end_now, short_error
from checkpointless.recovery.recover import stream_route
from checkpointless.recovery.rendezvous_client import make_store
from checkpointless.recovery.torchrun import start_from_first_replica

__all__ = ["START_OVER_EXIT", "Opening", "communicated", "finish_opening", "open_first_generation"]

log = get_logger()

# the exit status of a rank that ends because the job's start-up must start over (a fault after
# it had communicated before job.steps()); an ordinary fault to the launcher, which gives its
# rank to a spare
START_OVER_EXIT = 75


def open_first_generation(member: Member) -> None:
    """``init()`` under the launcher: form the first generation's groups (module docstring)."""
    member.recovery.after_abort = lambda msg: _on_abort(member)
    _form(member)


def communicated(member: Member) -> str | None:
    """What this rank has done through torch.distributed since its groups formed that a rank
    starting from the top would do again (and so could not meet here), or None."""
    default = member.groups.default
    groups = []
    made = 0
    if default is not None:
        groups.append(default.pg)
        if default.made is not None:
            groups.extend(default.made.groups())
            made = len(default.made.entries())
    if member.groups.mesh is not None:
        groups.extend(member.groups.mesh.mesh.groups)
    issued = sum(pg.issued for pg in set(groups))
    if issued:
        return f"ran {issued} collective(s)"
    if made:
        return f"made {made} group(s) with dist.new_group"
    return None


def _on_abort(member: Member) -> None:
    # on the link's reader thread, after the groups were aborted: end at once rather than when
    # the script next reaches a collective, which may be long (a data download)
    if member.opening is None:
        return
    why = communicated(member)
    if why is not None:
        _start_over(member, why)


def _start_over(member: Member, why: str) -> NoReturn:
    log.warning(
        "a rank was lost while the job was starting, after this rank %s before job.steps(): the "
        "lost rank's replacement runs the script from the top and would issue those collectives "
        "again with no partner, so rank %d starts over too: this process ends and a spare runs "
        "the script from the top in its place (nothing had trained yet; docs/adoption.md, "
        "'Collectives before the loop')",
        why,
        member.rank,
    )
    end_now(START_OVER_EXIT)


def _form(member: Member, error: str | None = None) -> None:
    """Report to the start-up round and form its generation's groups; loops through any faults
    that happen meanwhile (each makes a newer generation), as a recovery round does. ``error``:
    why this rank reports again (a fault it met in the first state sync)."""
    rc = member.recovery
    assert rc.link is not None
    rc.report_gen = max(rc.report_gen, rc.latest_abort, member.generation + 1)
    deadline = time.monotonic() + 10 * member.rendezvous_timeout
    # committed -1 and no mesh: this report forms groups only; the state sync is
    # finish_opening's, over those groups, once job.track() has named the state
    report = Stopped(for_generation=0, committed_step=-1, valid=True, cause="start", error=error)
    resend = True
    while True:
        gen = rc.report_gen
        if resend:
            rc.link.send(dataclasses.replace(report, for_generation=gen, time=time.time()))
        resend = False
        msg = rc.link.wait_for((Recover, Abort), deadline)
        if isinstance(msg, Abort):
            if msg.generation > rc.report_gen:  # a newer fault: report for it
                rc.report_gen = msg.generation
                resend = True
            continue
        if msg.generation != gen or rc.latest_abort > gen:
            continue  # a plan for a generation that was superseded while it travelled
        rc.cancel.clear()
        t0 = time.monotonic()
        try:
            store = make_store(
                msg.rendezvous, member.rank, member.world_size, gen, rc.store_state, member.env
            )
            wait_s = member.groups.rebuild(
                gen, store, member.rank, member.world_size, member.rendezvous_timeout, rc.cancel
            )
        except GroupsDisagree as e:  # the ranks made different groups: no recovery can help
            rc.fatal(str(e))
        except Exception as e:  # a fault of this round: report it and take part in the next
            log.warning("forming generation %d failed: %s", gen, short_error(e))
            report = dataclasses.replace(report, cause="recovery", error=short_error(e))
            rc.report_gen = max(rc.latest_abort, gen + 1)
            resend = True
            continue
        member.generation = gen
        member.opening = Opening(gen, msg, store, time.monotonic() - t0, wait_s)
        log.info(
            "generation %d formed in %.3f s (its state sync comes at job.steps())", gen, time.monotonic() - t0
        )
        return


def finish_opening(member: Member, start: int) -> None:
    """``job.steps()`` after :func:`open_first_generation`: the job's first state sync over the
    formed groups, ``Recovered``, and a barrier; the start step is the first replica's."""
    rc = member.recovery
    default = member.groups.default
    while True:
        op = member.opening
        if op is None or rc.latest_abort > member.generation:
            _reform(member, "aborted before the first state sync")
            continue
        if default is not None and default.made is not None:
            default.made.seal()  # a peer waiting for a group this rank never made is told so
        t1 = time.monotonic()
        try:
            target = start_from_first_replica(
                member.comm,
                member.tracked.objects,
                start,
                member.rank,
                member.world_size,
                member.rendezvous_timeout,
                member.groups.shards,
            )
            member.replicas.after_round(
                target, op.generation, stream_route(member, op.plan.rendezvous, op.generation)
            )
            member.committed_step = target
            member.record.settle(target, op.generation)
            timings: dict[str, Any] = {
                "rebuild_s": op.rebuild_s,
                "rendezvous_wait_s": op.rendezvous_wait_s,
                "role": "start",
                "transport": "gloo",
                "transfer_s": time.monotonic() - t1,
            }
            rc.send(Recovered(generation=op.generation, time=time.time(), timings=timings))
            # nobody trains before every rank holds the first state: a rank lost before it
            # reached job.steps() is met here, still in start-up, by every other rank
            member.comm.barrier(member.rendezvous_timeout)
        except Exception as e:
            log.info(
                "the first state sync of generation %d was interrupted: %s", op.generation, short_error(e)
            )
            member.groups.abort(f"rank {member.rank} left the first state sync")
            _reform(member, f"first state sync: {short_error(e)}")
            continue
        break
    member.opening = None
    member.clock.restart()
    rc.first_commit = True
    member.groups.release()
    log.info(
        "generation %d: state synchronised, starting at step %d", member.generation, member.committed_step
    )


def _reform(member: Member, error: str) -> None:
    """A fault before the first state sync completed: start over (this process ends) or report
    to the next start-up round from here (module docstring)."""
    why = communicated(member)
    if why is not None:
        _start_over(member, why)
    member.opening = None
    _form(member, error)
