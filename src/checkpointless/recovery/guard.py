"""Fault sites and the update guard: what the hooks that ``job.track()`` puts on the script's
modules and optimizers, and the job's collectives, do inside a step.

A *site* (forward, backward, allreduce, optimizer, step) is where a rehearsed fault fires, where
an exception deferred by the step's entry surfaces inside the script's own code, and, at the
first forward, where the time to assemble the batch is taken. The *update guard* runs around
every optimizer step: no update may change tensors a copy still reads, none may come from an
aborted generation, and on a sharded mesh no rank updates while another is still in one of the
step's collectives. Functions of the :class:`~checkpointless.recovery.job.Job` they act on, kept
apart from its public API in ``job.py`` (as commit.py keeps a step's entry and commit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from checkpointless.recovery.job import Job

__all__ = ["after_update", "before_update", "on_collective", "site"]


def site(job: Job, name: str) -> None:
    """The script reached site ``name`` of the current step."""
    if job._deferred is not None:
        e, job._deferred = job._deferred, None
        raise e
    if name == "forward":
        job.clock.first_forward()  # the time to fetch and assemble the batch
    if job.clock.step_index is not None:
        job._injector.maybe_fire(name, job.clock.step_index)


def on_collective(job: Job, kind: str) -> None:
    # an FSDP reduce-scatter runs inside backward; the replicate all-reduce is the job's
    site(job, "backward" if kind == "reduce_scatter" else "allreduce")


def before_update(job: Job, opt: Any, args: Any, kwargs: Any) -> None:
    # The update must not change tensors still being read: a snapshot's copy, DCP's staging,
    # the buddy copy's stream. Waited for before the barrier below, so that once past it
    # nothing can refuse the update: a buddy copy abandoned by an abort raises CommAborted
    # here, while every rank is still on this side of the barrier.
    job.replicas.wait_read(job.rendezvous_timeout, job.groups.aborted)  # abandoned with the generation
    if job.groups.shards > 1 and job._link is not None and job.world_size > 1:
        # Sharded state: no rank may apply its update while another is still inside one of the
        # step's collectives. Without this, a fault in one rank's update aborts a collective of
        # another shard's group still in flight, while a third rank has already updated: the
        # shards end at different steps, and the state of no single step exists anywhere (found
        # by the HSDP raise-mid-optimizer test). Past this barrier every rank has its gradients
        # and applies its update even if an abort arrives meanwhile (an update is never undone).
        job.comm.barrier(job.rendezvous_timeout)  # CommAborted: the step dies before any update
    else:
        job.groups.check()  # never apply an update from a generation that was aborted
    job._dirty = True
    if job.clock.step_index is not None and job._injector.due("optimizer", job.clock.step_index):
        # rehearse a fault half-way through the update: some parameters already changed
        with torch.no_grad():
            first = opt.param_groups[0]["params"][0]
            first.add_(1.0)
    site(job, "optimizer")


def after_update(job: Job, opt: Any, args: Any, kwargs: Any) -> None:
    job._dirty = False
    job._updated = True
