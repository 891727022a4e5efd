"""A worker's side of a recovery round: report the fault, join the next generation, send or
receive the state the plan names, and settle on the step to resume from.

Functions of the :class:`~checkpointless.recovery.member.Member` they act on, kept apart from
the step loop in ``driver.py``: the loop calls :func:`recover_from` when a step fails and
:func:`recover` when a collective outside a step (the final barrier, a section) does. Which
generators a rank resumes with is ``own_rng.py``; degraded mode's held slots in a round,
``held_round.py``.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any

from checkpointless.comm.script_groups import GroupsDisagree
from checkpointless.errors import CommAborted, StateTransferError
from checkpointless.events import get_logger
from checkpointless.protocol import Abort, Recover, Recovered, Stopped
from checkpointless.recovery.amp import finish_cut_off_update, reset_step_state
from checkpointless.recovery.held_round import (
    HeldSlotsInScriptGroups,
    fetch_held_records,
    fold_held_script_groups,
)
from checkpointless.recovery.member import Member
from checkpointless.recovery.own_rng import receiver_rng, restore_kept_rng, resume_rng
from checkpointless.recovery.process import looks_like_comm_error, short_error
from checkpointless.recovery.rendezvous_client import make_store
from checkpointless.recovery.section_pass import sections_report
from checkpointless.recovery.sharded import send_copies
from checkpointless.state.buddy import copy_channel
from checkpointless.state.durable import restore_checkpoint
from checkpointless.state.shm_dir import newest_snapshot, snapshot_dir
from checkpointless.state.shm_snapshot import restore_snapshot
from checkpointless.state.snapshot import (
    capture_rng,
    collect_state,
    landing_zone,
    restore_from,
    restore_rng,
    restore_state,
)
from checkpointless.state.transfer import StreamRoute, receive_state, send_state

__all__ = [
    "join_generation",
    "newest_own_snapshot",
    "recover",
    "recover_from",
    "restore_own_snapshot",
    "stream_route",
]

log = get_logger()


def recover_from(member: Member, index: int, exc: BaseException) -> None:
    # the rank's own error counts as its own even if an abort arrived at the same moment:
    # only a failed or aborted collective is a symptom of somebody else's fault
    cause = "comm" if isinstance(exc, CommAborted) or looks_like_comm_error(exc) else "exception"
    if member.guard.dirty:
        committed, valid = index, False
    elif member.guard.updated:
        committed, valid = index + 1, True
    else:
        committed, valid = index, True
    if member.guard.updated and not member.guard.dirty:  # the update stands: so must its scaler update
        for scaler in member.tracked.scalers:
            finish_cut_off_update(scaler)
    member.guard.dirty = False
    member.record.interrupt(index)
    if cause == "exception":
        retries = member.record.count_retry(index)
        log.error(
            "step %d raised %s: %s\n%s",
            index,
            type(exc).__name__,
            exc,
            "".join(traceback.format_exception(exc)).rstrip(),
        )
        if retries > member.max_step_retries:
            member.recovery.fatal(
                f"step {index} raised {type(exc).__name__} {retries} times in a row "
                f"({exc}); this is not a transient fault",
                kind="retries",  # a fresh process may still be tried (coordinator/rules/respawn.py)
                tries=retries,
            )
    else:
        log.info("step %d interrupted: %s", index, short_error(exc))
    member.groups.abort(f"rank {member.rank} left step {index}")
    recover(member, cause, f"{type(exc).__name__}: {exc}", committed, valid)


def recover(member: Member, cause: str, error: str | None, committed: int, valid: bool) -> None:
    """Report, wait for the launcher's plan, rebuild, exchange state. Loops through any
    number of faults that happen meanwhile (each makes a newer generation)."""
    assert member.recovery.link is not None
    member.clock.recovering = True
    t_stop = time.monotonic()
    member.replicas.stop(member.rendezvous_timeout)
    member.tracked.drop_step(member.groups.reset)  # what the abandoned forward/backward left
    deadline = time.monotonic() + 10 * member.rendezvous_timeout
    member.recovery.report_gen = max(
        member.recovery.report_gen, member.recovery.latest_abort, member.generation + 1
    )
    # the step that was running names the fault for the launcher's fault budget
    report = Stopped(
        for_generation=0,
        committed_step=committed,
        valid=valid,
        cause=cause,
        error=error,
        step=member.clock.step_index,
        **sections_report(member, committed),
    )
    resend = True
    while True:
        gen = member.recovery.report_gen
        if resend:
            snap = newest_own_snapshot(member)
            ckpts = member.replicas.checkpoint_steps()
            member.recovery.link.send(
                dataclasses.replace(
                    report,
                    for_generation=gen,
                    time=time.time(),
                    snapshot_step=snap,
                    checkpoint_step=ckpts[-1] if ckpts else None,
                    checkpoint_steps=ckpts,
                    mesh=list(member.groups.mesh.shape) if member.groups.mesh is not None else None,
                    copies=member.replicas.copies(),
                    own_snapshots=member.replicas.own_states(),
                )
            )
        resend = False
        msg = member.recovery.link.wait_for((Recover, Abort), deadline)
        if isinstance(msg, Abort):
            if msg.generation > member.recovery.report_gen:  # a newer fault: report for it
                member.recovery.report_gen = msg.generation
                resend = True
            continue
        if msg.generation != gen or member.recovery.latest_abort > gen:
            continue  # a plan for a generation that was superseded while it travelled
        member.recovery.cancel.clear()
        try:
            timings = join_generation(member, msg, committed, valid)
        except (GroupsDisagree, HeldSlotsInScriptGroups) as e:  # no recovery can help
            member.recovery.fatal(str(e))
        except Exception as e:  # any failure here is a fault of this round, not of the job
            log.warning("recovery to generation %d failed: %s", gen, short_error(e))
            # our own state is still what it was unless we were loading a peer's
            receivers = msg.plan.receivers
            if isinstance(e, StateTransferError) or member.rank in receivers:
                valid = valid and member.rank not in receivers
            report = dataclasses.replace(report, valid=valid, cause="recovery", error=short_error(e))
            member.recovery.report_gen = max(member.recovery.latest_abort, gen + 1)
            resend = True
            continue
        timings["stopped_s"] = t_stop
        for scaler in member.tracked.scalers:  # every step starts again with scaled gradients
            reset_step_state(scaler)
        member.clock.restart()  # the hang clock restarts with the new generation
        member.clock.recovering = False
        member.recovery.first_commit = True
        member.recovery.link.send(Recovered(generation=gen, time=time.time(), timings=timings))
        member.groups.release()
        return


def join_generation(member: Member, msg: Recover, committed: int, valid: bool) -> dict[str, Any]:
    gen = msg.generation
    plan = msg.plan
    target, receivers = plan.target_step, plan.receivers
    sources = plan.source_of()  # receiver -> its source (on a mesh, a holder of its shard)
    # receivers of this rank's own state; the buddy copies it keeps go out on a thread of their own
    to_send = sorted(r for r, s in sources.items() if s == member.rank and r not in plan.from_copy)
    member.guard.injector.maybe_fire("recovery", target)
    t0 = time.monotonic()
    held = [slot for slot, _ in plan.holders]  # their keys live in their holders' key servers
    store = make_store(
        msg.rendezvous, member.rank, member.world_size, gen, member.recovery.store_state, member.env, held
    )
    wait_s = _rebuild(member, msg, store)
    member.generation = gen
    t1 = time.monotonic()
    info: dict[str, Any] = {"rebuild_s": t1 - t0, "rendezvous_wait_s": wait_s, "role": "none"}
    route = stream_route(member, msg.rendezvous, gen)
    info["transport"] = "gloo" if route is None else "stream"
    copier = None
    if member.replicas.buddies is not None and route is not None:  # kept copies go back beside the rest
        copier = send_copies(
            member.replicas.buddies,
            member.comm,
            plan,
            member.rank,
            gen,
            target,
            route,
            member.rendezvous_timeout,
        )
    if plan.from_snapshot:
        info.update(restore_own_snapshot(member, target))
        info["role"] = info["transport"] = "snapshot"
        restore_kept_rng(member, target, route)
    elif (
        member.rank in plan.own_snapshot
        and member.replicas.buddies
        and target in member.replicas.buddies.undo_steps()
    ):
        buddies = member.replicas.buddies
        info.update(
            restore_from(member.tracked.objects, target, lambda own: (buddies.undo(target), {}), "undo copy")
        )
        info["role"] = info["transport"] = "undo"
        log.info("rolled back to this rank's own state as step %d began (its undo copy)", target)
    elif member.rank in plan.own_snapshot and member.replicas.own_snapshots is not None:
        stats = restore_snapshot(member.tracked.objects, member.replicas.own_snapshots, target)
        info.update(stats)
        info["role"] = info["transport"] = "own_snapshot"
        log.info("restored this rank's own snapshot of step %d", target)
    elif plan.from_checkpoint:
        if member.replicas.checkpoint_dir is None:
            raise StateTransferError("the plan restores a checkpoint, but this rank has no --checkpoint-dir")
        info.update(restore_checkpoint(member.tracked.objects, member.replicas.checkpoint_dir, target))
        info["role"] = info["transport"] = "checkpoint"
        restore_kept_rng(member, target, route)
        log.info("restored the checkpoint of step %d from %s", target, member.replicas.checkpoint_dir)
    elif to_send:
        rng = resume_rng(member, target)
        state = collect_state(member.tracked.objects, target, rng)
        info.update(send_state(member.comm, state, to_send, member.rendezvous_timeout, route))
        info["role"] = "source"
        restore_rng(rng)
    elif member.rank in receivers:
        # our own tensors are the landing zone: a receiver's state is replaced anyway, and
        # receiving in place spares a copy and a page fault per 4 KiB of state
        tc = time.monotonic()
        own = landing_zone(member.tracked.objects, target, capture_rng())
        info["state_collect_s"] = time.monotonic() - tc
        if member.replicas.arena is not None:
            member.replicas.arena.reset()  # a transfer that failed before may have taken some of it
        if route is not None and member.rank in plan.from_copy:
            route = dataclasses.replace(route, channel=copy_channel(gen, member.rank))
        state, stats = receive_state(
            member.comm, sources[member.rank], member.rendezvous_timeout, own, route, member.replicas.arena
        )
        del own
        if member.replicas.arena is not None:
            member.replicas.arena.release_unused()
            member.replicas.arena = None  # what was carved out lives on in the received tensors
        tr = time.monotonic()
        step, rng = restore_state(member.tracked.objects, state)
        member.loop.agree(plan.sections_closed, target)  # its source may not have passed one
        if step != target:
            raise StateTransferError(f"received state for step {step}, the plan says {target}")
        restore_rng(receiver_rng(member, target, rng, member.rank in plan.from_copy, route))
        info.update(stats)
        # transfer_s, split: state_collect_s (own tensors, the landing zone), recv_s (the stream,
        # hashed as it arrives), verify_s (digests compared, tree rebuilt), state_restore_s (the
        # load into the model and optimizer)
        info["state_restore_s"] = time.monotonic() - tr
        info["role"] = "receiver"
        if member.rank in plan.from_copy:
            info["transport"] = "buddy"
    else:
        restore_rng(resume_rng(member, target))
    if copier is not None:
        copier.join(member.rendezvous_timeout)
        if copier.error is not None:
            raise copier.error
    if route is not None and plan.holders:
        fetch_held_records(member, plan.holders, target, route)
    member.replicas.after_round(target, gen, stream_route(member, msg.rendezvous, gen))
    member.loop.agree(plan.sections_closed, target)  # the sections a peer passed the barrier of
    member.committed_step = target
    member.replay.arm(member.record.interrupted, target)  # a replay is checked as it commits
    member.record.settle(target, gen)  # the interrupted step, if rolled forward, commits now
    info["transfer_s"] = time.monotonic() - t1
    log.info(
        "generation %d formed in %.3f s, state %s in %.3f s; resuming at step %d",
        gen,
        info["rebuild_s"],
        info["role"],
        info["transfer_s"],
        target,
    )
    return info


def _rebuild(member: Member, msg: Recover, store: Any) -> float:
    """Form the generation's groups: this process's own and, degraded, those of the slots it
    holds (recovery/slots.py), together; the held slots' groups then reduce DataParallel's
    gradients beside its own."""
    fold_held_script_groups(member, msg)
    gen, held = msg.generation, member.groups.held
    deadline = time.monotonic() + member.rendezvous_timeout
    slots = [s for s in msg.plan.slots_of(member.rank) if s != member.rank]
    member.groups.hold_replicas(slots)  # degraded HSDP: the replicate group is this process alone
    forming = held.start_forming(
        slots,
        member.world_size,
        gen,
        lambda slot: make_store(
            msg.rendezvous,
            slot,
            member.world_size,
            gen,
            member.recovery.store_state,
            member.env,
            [s for s, _ in msg.plan.holders],
        ),
        member.comm,
        member.groups.default,
        deadline,
        member.recovery.cancel,
    )
    try:
        wait_s = member.groups.rebuild(
            gen, store, member.rank, member.world_size, member.rendezvous_timeout, member.recovery.cancel
        )
    finally:
        held.finish_forming(forming, deadline)
    for dp in member.tracked.dps:
        dp.hold(held.comms(member.comm))
    default = member.groups.default
    if default is not None and default.active:
        # the script's own collectives on torch's default group: the held slots' parts would
        # come from passes still to run (or never, between steps), so every rank would wait
        default.pg.refused = (
            f"a collective on torch's default group while this process holds the lost slots "
            f"{held.slots} (degraded mode): their parts of it are not computed, and every rank "
            "would wait; run such a script with --when-no-spare fail (docs/fault-model.md, "
            "degraded mode)"
            if held.slots
            else None
        )
    return wait_s


def newest_own_snapshot(member: Member) -> int | None:
    # reported with every stop, so the launcher can plan with it when no replica is left
    return newest_snapshot(snapshot_dir(member.env.job_id)) if member.env is not None else None


def restore_own_snapshot(member: Member, target: int) -> dict[str, Any]:
    assert member.env is not None
    stats = restore_snapshot(member.tracked.objects, snapshot_dir(member.env.job_id), target)
    log.info("restored the shared-memory snapshot of step %d (%.1f MB)", target, stats["bytes"] / 1e6)
    return stats


def stream_route(member: Member, desc: dict[str, Any], gen: int) -> StreamRoute | None:
    """State goes over a direct stream through the key servers of a root-less rendezvous;
    with a central store (``--rendezvous tcp``) over the gloo group instead."""
    server = member.recovery.store_state.get("server")
    if desc.get("kind") != "rootless" or server is None or member.env is None:
        return None
    return StreamRoute(server, list(desc["peers"]), member.env.secret, f"state/gen{gen}")
