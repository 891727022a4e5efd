"""A step's entry and its commit: fault sites and snapshots as a step begins, the commit rule
(snapshots, buddy copies, durable checkpoints, the launcher told) as it ends, and the periodic
divergence check between replicas. Functions of the
:class:`~checkpointless.recovery.job.Job` they act on, called by
:class:`~checkpointless.recovery.step.Step`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from checkpointless.errors import NotRecoverableError
from checkpointless.events import get_logger, set_log_step
from checkpointless.protocol import Committed
from checkpointless.recovery.divergence import Verdict, due, judge, state_digest
from checkpointless.recovery.process import short_error, state_bytes
from checkpointless.recovery.recover import recover
from checkpointless.state.snapshot import capture_rng

if TYPE_CHECKING:
    from checkpointless.recovery.job import Job

__all__ = ["check_divergence", "commit", "enter_step", "judge_replicas"]

log = get_logger()


def enter_step(job: Job, index: int) -> None:
    job.clock.begin(index, job.comm.waited_s)
    job.guard.updated = False
    job._record = {}
    job._step_rng = (index, capture_rng())
    job._streams.begin_step()
    set_log_step(index)
    job.replicas.begin_step(
        index, job.tracked.objects, job.tracked.optimizers, job._step_rng[1], job.clock.progress_t
    )
    try:
        job.guard.site("step")
    except Exception as e:  # surfaced at the first hook inside the body (see UpdateGuard.site)
        job.guard.deferred = e


def commit(job: Job, index: int) -> None:
    job.committed_step = index + 1
    job.guard.updated = False
    job.clock.commit(job.comm.waited_s)
    job._retries.pop(index, None)
    job._record.update(job.replicas.published())
    if job._events is not None:
        job._events.emit("commit", step=index, generation=job.generation, **job._record)
    if job.recovery.first_commit and job.recovery.connected:
        job.recovery.first_commit = False
        job.recovery.send(
            Committed(
                generation=job.generation,
                step=index,
                time=time.time(),
                first_batch_s=job.clock.batch_s,
                # how much memory a spare should page in for this replica's state
                state_bytes=state_bytes(job.tracked.objects) if job.rank == 0 else None,
            )
        )


def check_divergence(job: Job) -> None:
    """Every ``divergence_every`` commits: compare the replicas' digests (recovery/divergence.py);
    a rank that differs from the majority reports itself invalid and receives its state."""
    step = job.committed_step
    if job.world_size < 2 or not due(step, job.divergence_every):
        return
    if not job.recovery.connected and not job.under_torchrun:
        return
    shards = job.groups.shards
    if job.groups.mesh is not None and job.groups.mesh.replicate == 1:
        return  # plain FSDP: every shard exists once, there is no replica to compare it with
    digest = state_digest(job.tracked.modules, job.tracked.optimizers)
    mine = torch.tensor([digest], dtype=torch.int64, device=job.device)
    try:
        gathered = job.comm.wait(job.comm.allgather(mine), job.rendezvous_timeout)
    except Exception as e:  # a peer failed meanwhile: this step stands, recover as usual
        if not job.recovery.connected:
            raise
        job.comm.abort(f"rank {job.rank} left the divergence check after step {step - 1}")
        recover(job, "comm", short_error(e), step, True)
        return
    verdict = judge_replicas([int(t.item()) for t in gathered], shards)
    if not verdict.divergent:
        return
    why = verdict.describe(step)
    mine_bad = job.rank in verdict.divergent
    log.error("%s%s", why, " (this rank is one of them)" if mine_bad else "")
    if job._events is not None:
        job._events.emit("divergence", step=step - 1, ranks=list(verdict.divergent))
    if not job.recovery.connected:  # under plain torchrun: nothing can heal it
        raise NotRecoverableError(why)
    if not mine_bad:
        # Only a divergent rank reports. Were the majority to report too, the launcher's abort
        # could cut a slower divergent rank's all-gather short before it saw the verdict, and
        # it would report itself valid. The majority goes on; its next collective is aborted
        # by the round the divergent rank starts, and it reports then (valid, at this step).
        return
    job.comm.abort(f"divergence check after step {step - 1}")
    # Its snapshots and undo copies up to here may hold the divergent state (it began somewhere
    # since the last check): a later rollback must not restore one of them, so none is offered.
    job.replicas.own_states_after = step
    recover(job, "exception", why, step, False)


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


# -- recovery ------------------------------------------------------------------------------
