"""A worker's side of a recovery round: report the fault, join the next generation, send or
receive the state the plan names, and settle on the step to resume from.

Functions of the :class:`~checkpointless.recovery.job.Job` they act on, kept apart from the
step loop in ``driver.py``: the loop calls :func:`recover_from` when a step fails and
:func:`recover` when a collective outside a step (the final barrier, a section) does.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import TYPE_CHECKING, Any

from checkpointless.errors import CommAborted, StateTransferError
from checkpointless.events import get_logger
from checkpointless.protocol import Abort, Recover, Recovered, Stopped
from checkpointless.recovery.amp import finish_cut_off_update, reset_step_state
from checkpointless.recovery.process import looks_like_comm_error, short_error
from checkpointless.recovery.rendezvous_client import make_store
from checkpointless.recovery.sharded import send_copies
from checkpointless.state.buddy import copy_channel
from checkpointless.state.durable import restore_checkpoint
from checkpointless.state.shm_dir import newest_snapshot, snapshot_dir
from checkpointless.state.shm_snapshot import restore_snapshot
from checkpointless.state.snapshot import (
    RngState,
    capture_rng,
    collect_state,
    landing_zone,
    restore_from,
    restore_rng,
    restore_state,
)
from checkpointless.state.transfer import StreamRoute, receive_state, send_state

if TYPE_CHECKING:
    from checkpointless.recovery.job import Job

__all__ = [
    "join_generation",
    "newest_own_snapshot",
    "plan_sources",
    "recover",
    "recover_from",
    "restore_own_snapshot",
    "resume_rng",
    "stream_route",
]

log = get_logger()


def plan_sources(plan: dict[str, Any]) -> dict[int, int]:
    """receiver -> source from a plan's JSON: per-receiver pairs when present (a sharded mesh),
    else one source for every receiver; empty for snapshot and checkpoint plans."""
    if plan.get("from_snapshot") or plan.get("from_checkpoint"):
        return {}
    if plan.get("sources") or plan.get("own_snapshot"):
        return {int(r): int(s) for r, s in plan.get("sources", [])}
    return {int(r): int(plan["source"]) for r in plan["receivers"]}


def recover_from(job: Job, index: int, exc: BaseException) -> None:
    # the rank's own error counts as its own even if an abort arrived at the same moment:
    # only a failed or aborted collective is a symptom of somebody else's fault
    cause = "comm" if isinstance(exc, CommAborted) or looks_like_comm_error(exc) else "exception"
    if job.guard.dirty:
        committed, valid = index, False
    elif job.guard.updated:
        committed, valid = index + 1, True
    else:
        committed, valid = index, True
    if job.guard.updated and not job.guard.dirty:  # the update stands: so must its scaler update
        for scaler in job.tracked.scalers:
            finish_cut_off_update(scaler)
    job.guard.dirty = False
    job._interrupted = (index, dict(job._record))
    if cause == "exception":
        job._retries[index] = job._retries.get(index, 0) + 1
        log.error(
            "step %d raised %s: %s\n%s",
            index,
            type(exc).__name__,
            exc,
            "".join(traceback.format_exception(exc)).rstrip(),
        )
        if job._retries[index] > job.max_step_retries:
            job.recovery.fatal(
                f"step {index} raised {type(exc).__name__} {job._retries[index]} times in a row "
                f"({exc}); this is not a transient fault",
            )
    else:
        log.info("step %d interrupted: %s", index, short_error(exc))
    job.groups.abort(f"rank {job.rank} left step {index}")
    recover(job, cause, f"{type(exc).__name__}: {exc}", committed, valid)


def recover(job: Job, cause: str, error: str | None, committed: int, valid: bool) -> None:
    """Report, wait for the launcher's plan, rebuild, exchange state. Loops through any
    number of faults that happen meanwhile (each makes a newer generation)."""
    assert job.recovery.link is not None
    job.clock.recovering = True
    t_stop = time.monotonic()
    job.replicas.stop(job.rendezvous_timeout)
    job.tracked.drop_step(job.groups.reset)  # what the abandoned forward/backward left
    deadline = time.monotonic() + 10 * job.rendezvous_timeout
    job.recovery.report_gen = max(job.recovery.report_gen, job.recovery.latest_abort, job.generation + 1)
    # the step that was running names the fault for the launcher's fault budget
    report = Stopped(
        for_generation=0,
        committed_step=committed,
        valid=valid,
        cause=cause,
        error=error,
        step=job.clock.step_index,
    )
    resend = True
    while True:
        gen = job.recovery.report_gen
        if resend:
            snap = newest_own_snapshot(job)
            ckpts = job.replicas.checkpoint_steps()
            job.recovery.link.send(
                dataclasses.replace(
                    report,
                    for_generation=gen,
                    time=time.time(),
                    snapshot_step=snap,
                    checkpoint_step=ckpts[-1] if ckpts else None,
                    checkpoint_steps=ckpts,
                    mesh=list(job.groups.mesh.shape) if job.groups.mesh is not None else None,
                    copies=job.replicas.copies(),
                    own_snapshots=job.replicas.own_states(),
                )
            )
        resend = False
        msg = job.recovery.link.wait_for((Recover, Abort), deadline)
        if isinstance(msg, Abort):
            if msg.generation > job.recovery.report_gen:  # a newer fault: report for it
                job.recovery.report_gen = msg.generation
                resend = True
            continue
        if msg.generation != gen or job.recovery.latest_abort > gen:
            continue  # a plan for a generation that was superseded while it travelled
        job.recovery.cancel.clear()
        try:
            timings = join_generation(job, msg, committed, valid)
        except Exception as e:  # any failure here is a fault of this round, not of the job
            log.warning("recovery to generation %d failed: %s", gen, short_error(e))
            # our own state is still what it was unless we were loading a peer's
            # (.get: the plan may be one the link could not read, passed on as it came)
            receivers = msg.plan.get("receivers", ())
            if isinstance(e, StateTransferError) or job.rank in receivers:
                valid = valid and job.rank not in receivers
            report = dataclasses.replace(report, valid=valid, cause="recovery", error=short_error(e))
            job.recovery.report_gen = max(job.recovery.latest_abort, gen + 1)
            resend = True
            continue
        timings["stopped_s"] = t_stop
        for scaler in job.tracked.scalers:  # every step starts again with scaled gradients
            reset_step_state(scaler)
        job.clock.restart()  # the hang clock restarts with the new generation
        job.clock.recovering = False
        job.recovery.first_commit = True
        job.recovery.link.send(Recovered(generation=gen, time=time.time(), timings=timings))
        job.groups.release()
        return


def join_generation(job: Job, msg: Recover, committed: int, valid: bool) -> dict[str, Any]:
    gen = msg.generation
    plan = msg.plan
    target, receivers = int(plan["target_step"]), list(plan["receivers"])
    sources = plan_sources(plan)  # receiver -> its source (on a mesh, a holder of its shard)
    # receivers of this rank's own state; the buddy copies it keeps go out on a thread of their own
    to_send = sorted(r for r, s in sources.items() if s == job.rank and r not in plan.get("from_copy", ()))
    job.guard.injector.maybe_fire("recovery", target)
    t0 = time.monotonic()
    store = make_store(msg.rendezvous, job.rank, job.world_size, gen, job.recovery.store_state, job.env)
    wait_s = job.groups.rebuild(
        gen, store, job.rank, job.world_size, job.rendezvous_timeout, job.recovery.cancel
    )
    job.generation = gen
    t1 = time.monotonic()
    info: dict[str, Any] = {"rebuild_s": t1 - t0, "rendezvous_wait_s": wait_s, "role": "none"}
    route = stream_route(job, msg.rendezvous, gen)
    info["transport"] = "gloo" if route is None else "stream"
    copier = None
    if job.replicas.buddies is not None and route is not None:  # kept copies go back beside the rest
        copier = send_copies(
            job.replicas.buddies, job.comm, plan, job.rank, gen, target, route, job.rendezvous_timeout
        )
    if plan.get("from_snapshot"):
        info.update(restore_own_snapshot(job, target))
        info["role"] = info["transport"] = "snapshot"
    elif (
        job.rank in plan.get("own_snapshot", ())
        and job.replicas.buddies
        and target in job.replicas.buddies.undo_steps()
    ):
        buddies = job.replicas.buddies
        info.update(
            restore_from(job.tracked.objects, target, lambda own: (buddies.undo(target), {}), "undo copy")
        )
        info["role"] = info["transport"] = "undo"
        log.info("rolled back to this rank's own state as step %d began (its undo copy)", target)
    elif job.rank in plan.get("own_snapshot", ()) and job.replicas.own_snapshots is not None:
        stats = restore_snapshot(job.tracked.objects, job.replicas.own_snapshots, target)
        info.update(stats)
        info["role"] = info["transport"] = "own_snapshot"
        log.info("restored this rank's own snapshot of step %d", target)
    elif plan.get("from_checkpoint"):
        if job.replicas.checkpoint_dir is None:
            raise StateTransferError("the plan restores a checkpoint, but this rank has no --checkpoint-dir")
        info.update(restore_checkpoint(job.tracked.objects, job.replicas.checkpoint_dir, target))
        info["role"] = info["transport"] = "checkpoint"
        log.info("restored the checkpoint of step %d from %s", target, job.replicas.checkpoint_dir)
    elif to_send:
        rng = resume_rng(job, target)
        state = collect_state(job.tracked.objects, target, rng)
        info.update(send_state(job.comm, state, to_send, job.rendezvous_timeout, route))
        info["role"] = "source"
        restore_rng(rng)
    elif job.rank in receivers:
        # our own tensors are the landing zone: a receiver's state is replaced anyway, and
        # receiving in place spares a copy and a page fault per 4 KiB of state
        tc = time.monotonic()
        own = landing_zone(job.tracked.objects, target, capture_rng())
        info["state_collect_s"] = time.monotonic() - tc
        if job.replicas.arena is not None:
            job.replicas.arena.reset()  # a transfer that failed before may have taken some of it
        if route is not None and job.rank in plan.get("from_copy", ()):
            route = dataclasses.replace(route, channel=copy_channel(gen, job.rank))
        state, stats = receive_state(
            job.comm, sources[job.rank], job.rendezvous_timeout, own, route, job.replicas.arena
        )
        del own
        if job.replicas.arena is not None:
            job.replicas.arena.release_unused()
            job.replicas.arena = None  # what was carved out lives on in the received tensors
        tr = time.monotonic()
        step, rng = restore_state(job.tracked.objects, state)
        if step != target:
            raise StateTransferError(f"received state for step {step}, the plan says {target}")
        restore_rng(rng)
        info.update(stats)
        # transfer_s, split: state_collect_s (own tensors, the landing zone), recv_s (the stream,
        # hashed as it arrives), verify_s (digests compared, tree rebuilt), state_restore_s (the
        # load into the model and optimizer)
        info["state_restore_s"] = time.monotonic() - tr
        info["role"] = "receiver"
        if job.rank in plan.get("from_copy", ()):
            info["transport"] = "buddy"
    else:
        restore_rng(resume_rng(job, target))
    if copier is not None:
        copier.join(job.rendezvous_timeout)
        if copier.error is not None:
            raise copier.error
    job.replicas.after_round(target, gen, stream_route(job, msg.rendezvous, gen))
    job.committed_step = target
    job._step_rng = None
    if job._interrupted is not None and job._interrupted[0] == target - 1 and job._events is not None:
        # the interrupted step's update was applied (here or on the replica we received from):
        # its batch was trained on, so it is committed, not replayed
        index, record = job._interrupted
        job._events.emit("commit", step=index, generation=gen, rolled_forward=True, **record)
    job._interrupted = None
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


def newest_own_snapshot(job: Job) -> int | None:
    # reported with every stop, so the launcher can plan with it when no replica is left
    return newest_snapshot(snapshot_dir(job.env.job_id)) if job.env is not None else None


def restore_own_snapshot(job: Job, target: int) -> dict[str, Any]:
    assert job.env is not None
    stats = restore_snapshot(job.tracked.objects, snapshot_dir(job.env.job_id), target)
    log.info("restored the shared-memory snapshot of step %d (%.1f MB)", target, stats["bytes"] / 1e6)
    return stats


def stream_route(job: Job, desc: dict[str, Any], gen: int) -> StreamRoute | None:
    """State goes over a direct stream through the key servers of a root-less rendezvous;
    with a central store (``--rendezvous tcp``) over the gloo group instead."""
    server = job.recovery.store_state.get("server")
    if desc.get("kind") != "rootless" or server is None or job.env is None:
        return None
    return StreamRoute(server, list(desc["peers"]), job.env.secret, f"state/gen{gen}")


def resume_rng(job: Job, target: int) -> RngState:
    # The generators as they stood when step `target` first began here; if this rank never
    # began it (it finished the step before), its current state is that state.
    if job._step_rng is not None and job._step_rng[0] == target:
        return job._step_rng[1]
    return capture_rng()
