"""A step's entry and its commit: fault sites and snapshots as a step begins, the commit rule
(snapshots, buddy copies, durable checkpoints, the launcher told) as it ends, and the periodic
divergence check between replicas. Functions of the
:class:`~checkpointless.recovery.member.Member` they act on, called by
:class:`~checkpointless.recovery.step.Step`.
"""

from __future__ import annotations

import time

import torch

from checkpointless.errors import NotRecoverableError
from checkpointless.events import get_logger, set_log_step
from checkpointless.protocol import Committed, ReplayDiffers
from checkpointless.recovery import fingerprint
from checkpointless.recovery.divergence import Verdict, due, judge, state_digest
from checkpointless.recovery.member import Member
from checkpointless.recovery.process import short_error, state_bytes
from checkpointless.recovery.recover import recover
from checkpointless.recovery.warm_specs import describe

__all__ = ["check_divergence", "check_replay", "commit", "enter_step", "judge_replicas"]

log = get_logger()


def enter_step(member: Member, index: int) -> None:
    member.clock.begin(index, member.comm.waited_s)
    member.guard.updated = False
    rng = member.record.begin(index)
    set_log_step(index)
    member.replicas.begin_step(
        index, member.tracked.objects, member.tracked.optimizers, rng, member.clock.progress_t
    )
    try:
        member.guard.site("step")
    except Exception as e:  # surfaced at the first hook inside the body (see UpdateGuard.site)
        member.guard.deferred = e
    if fingerprint.ACTIVE is not None:  # only under `checkpointless audit`
        fingerprint.ACTIVE.begin_step()


def commit(member: Member, index: int) -> None:
    member.committed_step = index + 1
    member.guard.updated = False
    member.clock.commit(member.comm.waited_s)
    member.record.retries.pop(index, None)
    member.record.fields.update(member.replicas.published())
    check_replay(member, index)
    member.replicas.rank_rng.at_commit(index)  # where the next step starts (recovery/rank_rng.py)
    if fingerprint.ACTIVE is not None:  # only under `checkpointless audit`
        t = member.tracked
        fingerprint.ACTIVE.at_commit(member.rank, index, t.modules, t.optimizers, member.loop)
    member.record.emit("commit", step=index, generation=member.generation)
    if member.recovery.first_commit and member.recovery.connected:
        member.recovery.first_commit = False
        member.recovery.send(
            Committed(
                generation=member.generation,
                step=index,
                time=time.time(),
                first_batch_s=member.clock.batch_s,
                # how much memory a spare should page in for this replica's state
                state_bytes=state_bytes(member.tracked.objects) if member.rank == 0 else None,
                # what a spare warms up on: described once, by rank 0, in the first generation
                warm=describe(member.tracked.optimizers)
                if member.rank == 0 and member.generation == 0
                else None,
            )
        )


def check_replay(member: Member, index: int) -> None:
    """The first replay of a step a fault interrupted here, against that attempt's recorded loss
    (recovery/replay_check.py): its commit event says ``replay_loss`` ``same`` or ``differs``,
    and a difference is a warning here and a ``replay_differs`` event from the launcher."""
    verdict = member.replay.check(index, member.record.fields)
    if verdict is None:
        return
    member.record.fields["replay_loss"] = "same" if verdict.same else "differs"
    if verdict.same:
        return
    log.warning(
        "step %d replayed to loss %s, its interrupted attempt had %s: something in the step is not a "
        "function of its state and its step (a data order, a generator, a kernel); the run may "
        "differ from the run without the fault (`checkpointless audit` names the cause)",
        index,
        verdict.replayed,
        verdict.interrupted,
    )
    member.recovery.send(
        ReplayDiffers(
            step=index,
            interrupted=verdict.interrupted,
            replayed=verdict.replayed,
            generation=member.generation,
        )
    )


def check_divergence(member: Member) -> None:
    """Every ``divergence_every`` commits: compare the replicas' digests (recovery/divergence.py);
    a rank that differs from the majority reports itself invalid and receives its state."""
    step = member.committed_step
    if member.world_size < 2 or not due(step, member.divergence_every):
        return
    if not member.recovery.connected and not member.under_torchrun:
        return
    shards = member.groups.shards
    if member.groups.mesh is not None and member.groups.mesh.replicate == 1:
        return  # plain FSDP: every shard exists once, there is no replica to compare it with
    digest = state_digest(member.tracked.modules, member.tracked.optimizers)
    try:
        gathered = _gather_digests(member, digest)
    except Exception as e:  # a peer failed meanwhile: this step stands, recover as usual
        if not member.recovery.connected:
            raise
        member.comm.abort(f"rank {member.rank} left the divergence check after step {step - 1}")
        recover(member, "comm", short_error(e), step, True)
        return
    verdict = judge_replicas([int(t.item()) for t in gathered], shards)
    if not verdict.divergent:
        return
    why = verdict.describe(step)
    mine_bad = member.rank in verdict.divergent
    log.error("%s%s", why, " (this rank is one of them)" if mine_bad else "")
    if member.record.events is not None:  # (not emit(): the step's own fields are the commit's)
        member.record.events.emit("divergence", step=step - 1, ranks=list(verdict.divergent))
    if not member.recovery.connected:  # under plain torchrun: nothing can heal it
        raise NotRecoverableError(why)
    if not mine_bad:
        # Only a divergent rank reports. Were the majority to report too, the launcher's abort
        # could cut a slower divergent rank's all-gather short before it saw the verdict, and
        # it would report itself valid. The majority goes on; its next collective is aborted
        # by the round the divergent rank starts, and it reports then (valid, at this step).
        return
    member.comm.abort(f"divergence check after step {step - 1}")
    # Its snapshots and undo copies up to here may hold the divergent state (it began somewhere
    # since the last check): a later rollback must not restore one of them, so none is offered.
    member.replicas.own_states_after = step
    recover(member, "exception", why, step, False)


def _gather_digests(member: Member, digest: int) -> list[torch.Tensor]:
    """Every slot's replica digest, in slot order. A degraded holder is also the rank of each
    slot it holds in the job's width-N group (recovery/slots.py): it gives its own digest as
    theirs (their replica is its own), all at once, as DataParallel's reduction does; a slot left
    out would hold every rank in the all-gather until the hang rules ended the job."""
    deadline = time.monotonic() + member.rendezvous_timeout
    comms = member.groups.held.comms(member.comm) or [member.comm]
    mine = [torch.tensor([digest], dtype=torch.int64, device=member.device) for _ in comms]
    handles = [comm.allgather(t) for comm, t in zip(comms, mine, strict=True)]  # all issued first
    results = [member.comm.wait(h, max(0.0, deadline - time.monotonic())) for h in handles]
    return results[0]  # type: ignore[no-any-return]  # one collective: every handle sees the same


def judge_replicas(digests: list[int], shards: int) -> Verdict:
    """:func:`~checkpointless.recovery.divergence.judge` over each shard's replicas. On a
    (replicate, shard) mesh rank r holds shard ``r % shards``: only ranks of one shard must agree
    (different shards differ by design). ``shards`` 1 is plain data parallelism."""
    divergent: list[int] = []
    majority = True
    for col in range(shards):
        ranks = list(range(col, len(digests), shards))
        v = judge([digests[r] for r in ranks])
        divergent += [ranks[i] for i in v.divergent]
        majority = majority and v.has_majority
    return Verdict(tuple(sorted(divergent)), majority)
