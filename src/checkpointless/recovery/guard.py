"""Fault sites and the update guard: what the hooks that ``job.track()`` puts on the script's
modules and optimizers, and the job's collectives, do inside a step.

A *site* (forward, backward, allreduce, p2p, optimizer, step) is where a rehearsed fault fires, where
an exception deferred by the step's entry surfaces inside the script's own code, and, at the
first forward, where the time to assemble the batch is taken. The *update guard* runs around
every optimizer step: no update may change tensors a copy still reads, none may come from an
aborted generation, and on a sharded mesh no rank updates while another is still in one of the
step's collectives. :class:`UpdateGuard` owns what the step's hooks know (the fault injector, an
exception deferred to the first site, whether the update is under way or applied) and is given
the step clock, the replica keeper and the groups it consults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from checkpointless.faults.inject import Injector
from checkpointless.recovery import fingerprint
from checkpointless.recovery.clock import StepClock
from checkpointless.recovery.groups import Groups
from checkpointless.recovery.replicas import ReplicaKeeper

__all__ = ["UpdateGuard"]


class UpdateGuard:
    """The hooks of the step running. ``lockstep`` says whether a sharded update waits for
    every rank (under the launcher, with more than one rank); ``timeout`` bounds each wait."""

    def __init__(
        self,
        clock: StepClock,
        replicas: ReplicaKeeper,
        groups: Groups,
        timeout: float,
        lockstep: Callable[[], bool],
    ) -> None:
        self._clock = clock
        self._replicas = replicas
        self._groups = groups
        self._timeout = timeout
        self._lockstep = lockstep
        self.injector = Injector([], 0, set(), lambda spec, step: None)  # the rehearsed faults (--inject)
        self.deferred: BaseException | None = None  # raised at the step's first site
        self.dirty = False  # inside an optimizer update: state not valid if we fault now
        self.updated = False  # the current step's update has been applied

    def site(self, name: str) -> None:
        """The script reached site ``name`` of the current step."""
        if self.deferred is not None:
            e, self.deferred = self.deferred, None
            raise e
        if name == "forward":
            self._clock.first_forward()  # the time to fetch and assemble the batch
        if self._clock.step_index is not None:
            # the step's first all-reduce after its forward: its draws are done (rank_rng.py)
            if name == "allreduce" and self._clock.in_section is None and self._clock.batch_s is not None:
                self._replicas.rank_rng.at_collective(self._clock.step_index)
            self.injector.maybe_fire(name, self._clock.step_index)

    def gather(self) -> None:
        """Before a killall fault fires on this rank (faults/inject.py): wait for the copies this
        step began, then for every rank (held slots included) to get here, so that none dies
        before all are past the point where a peer's death would abort them into a recovery."""
        self._replicas.wait_written(self._timeout)
        self._groups.held.barrier(self._groups.comm, self._timeout)

    def on_forward(self, args: Any) -> None:
        """A tracked module's forward is about to run on ``args``."""
        if fingerprint.ACTIVE is not None:  # only under `checkpointless audit`
            fingerprint.ACTIVE.add_inputs(args)
        self.site("forward")

    def on_collective(self, kind: str) -> None:
        # an FSDP reduce-scatter runs inside backward; the replicate all-reduce is the job's;
        # a send or receive is a pipeline stage's activation or gradient (its own site, "p2p")
        if kind in ("send", "recv"):
            self.site("p2p")
        else:
            self.site("backward" if kind == "reduce_scatter" else "allreduce")

    def before_update(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._replicas.rank_rng.at_update(self._clock.step_index)  # the step's draws are done
        # The update must not change tensors still being read: a snapshot's copy, DCP's staging,
        # the buddy copy's stream. Waited for before the barrier below, so that once past it
        # nothing can refuse the update: a buddy copy abandoned by an abort raises CommAborted
        # here, while every rank is still on this side of the barrier.
        self._replicas.wait_read(self._timeout, self._groups.aborted)  # abandoned with the generation
        if self._groups.shards > 1 and self._lockstep():
            # Sharded state: no rank may apply its update while another is still inside one of
            # the step's collectives. Without this, a fault in one rank's update aborts a
            # collective of another shard's group still in flight, while a third rank has
            # already updated: the shards end at different steps, and the state of no single
            # step exists anywhere (found by the HSDP raise-mid-optimizer test). Past this
            # barrier every rank has its gradients and applies its update even if an abort
            # arrives meanwhile (an update is never undone).
            # CommAborted: the step dies before any update; degraded, every held slot's too
            self._groups.held.barrier(self._groups.comm, self._timeout)
        else:
            self._groups.check()  # never apply an update from a generation that was aborted
        if fingerprint.ACTIVE is not None:  # only under `checkpointless audit`
            fingerprint.ACTIVE.add_grads(opt)
        self.dirty = True
        index = self._clock.step_index
        if index is not None and self.injector.due("optimizer", index):
            # rehearse a fault half-way through the update: some parameters already changed
            with torch.no_grad():
                first = opt.param_groups[0]["params"][0]
                first.add_(1.0)
        self.site("optimizer")

    def after_update(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.dirty = False
        self.updated = True
