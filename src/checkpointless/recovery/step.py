"""One step of ``job.steps()``: a context manager whose block commits when it ends cleanly and
hands an exception to the recovery instead of raising it. It also knows its epoch and its batch,
from the job's schedule (``schedule.py``: ``steps_per_epoch`` or its one loader).

Degraded mode (docs/fault-model.md): a process that holds more than one data-parallel slot runs
each step once per slot (a *pass*; ``step.slot`` says whose micro-batch). Only the last pass
updates: before it, the tracked optimizers' and schedulers' ``step()`` do nothing, and
``DataParallel`` keeps the pass's gradient aside; the last pass commits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from checkpointless.errors import ConfigError
from checkpointless.recovery.commit import check_divergence, commit, enter_step
from checkpointless.recovery.member import Member
from checkpointless.recovery.own_rng import report_inexact
from checkpointless.recovery.recover import recover_from

__all__ = ["Step"]


class Step:
    """One training step; use as a context manager around the step's body.

    ``index`` is the step being run (a replay runs the same index again), ``committed`` whether
    its block ended cleanly (check it after the ``with`` block). ``slot`` is the data-parallel
    slot whose micro-batch this pass trains: the rank's own, except in degraded mode's extra
    passes; read the batch of ``(step.slot, step.index)``."""

    def __init__(
        self, member: Member, index: int, *, slot: int | None = None, pass_index: int = 0, passes: int = 1
    ) -> None:
        self._member = member
        self.index = index
        self.slot = member.rank if slot is None else slot
        self.pass_index = pass_index
        self.passes = passes
        self.committed = False
        self.passed = False  # its block ended cleanly (the last pass also committed)
        self.entered = False  # job.steps() refuses a step whose body ran outside `with step:`
        self._restore: list[Callable[[], None]] = []

    @property
    def epoch(self) -> int:
        """The epoch this step belongs to (``steps_per_epoch`` of job.steps(), or its loader's)."""
        return self.index // self._member.schedule.per_epoch(self._member.tracked.loaders)

    @property
    def index_in_epoch(self) -> int:
        """The step's place inside its epoch, from 0."""
        return self.index % self._member.schedule.per_epoch(self._member.tracked.loaders)

    @property
    def batch(self) -> Any:
        """This step's batch (the same object in a replay), from job.epochs()' loader or the one
        job.loader(); read it inside ``with step:``. In degraded mode's pass for a held slot it
        is that slot's batch (recovery/loader.py)."""
        return self._member.schedule.batch(self.index, self._member.tracked.loaders)

    @property
    def last_pass(self) -> bool:
        return self.pass_index == self.passes - 1

    def __enter__(self) -> Step:
        self.entered = True
        # the loaders and job.generator() read the held slot's share in its pass
        self._member.clock.held_slot = self.slot if self.slot != self._member.rank else None
        if self.pass_index == 0:
            enter_step(self._member, self.index)
        else:  # a held slot's pass draws from the slot's own generators (recovery/slot_rng.py)
            m, index = self._member, self.index
            m.held_rng.enter(
                m.replicas, m.job_id, self.slot, index, lambda why: report_inexact(m, index, "rng", why)
            )
        for dp in self._member.tracked.dps:
            if dp.passes == self.passes:
                dp.begin_pass(self.pass_index)
        # degraded HSDP: FSDP2's replicate all-reduce waits for the last pass (recovery/groups.py)
        self._member.groups.begin_pass(self._member.tracked.modules, self.last_pass)
        if not self.last_pass:
            self._defer_updates()
        return self

    def _defer_updates(self) -> None:
        """Before the last pass, the update waits: every tracked optimizer's and scheduler's
        ``step()`` does nothing (the instance attribute shadows the method until __exit__).

        The optimizers are taken from ``tracked.optimizers``, not from the tracked objects: an
        optimizer over DTensors (FSDP2, HSDP) is tracked as its local shards' view
        (recovery/sharded.py), which is no ``Optimizer``. Missed, its ``step()`` ran in every
        pass: a no-op there (the held-back gradients are None), but it passed the update guard,
        which then took a step cut off in its last pass for updated and rolled it forward
        without its update (seen in degraded HSDP: every rank's weights wrong from then on)."""
        m = self._member
        schedulers = [
            o for o in m.tracked.objects.values() if isinstance(o, torch.optim.lr_scheduler.LRScheduler)
        ]
        for obj in {id(o): o for o in [*m.tracked.optimizers, *schedulers]}.values():
            self._restore.append(_shadow_step(obj))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        self._member.clock.held_slot = None
        for undo in self._restore:
            undo()
        self._restore = []
        m = self._member
        if exc is None and not self.last_pass:
            if self.pass_index == 0:
                m.held_rng.own_pass_ended(m.replicas, self.index)
            m.held_rng.leave(m.replicas)
            m.record.end_pass(self.slot)  # what the pass recorded is its slot's
            self.passed = True  # the next pass trains the next slot's micro-batch
            return False
        if exc is None:
            held: dict[int, dict[str, Any]] = {}
            if self.passes > 1:
                m.record.end_pass(self.slot)
                held = m.record.take_passes(m.rank)
            commit(m, self.index)  # the last pass's record keeping is its slot's
            m.record.emit_held(self.index, m.generation, held, m.rank)
            m.held_rng.leave(m.replicas)
            self.committed = self.passed = True
            check_divergence(m)
            return False
        m.held_rng.leave(m.replicas)  # the recovery resumes this rank's own generators
        if not isinstance(exc, Exception) or not self._member.recovery.connected:
            return False  # KeyboardInterrupt/SystemExit, or no launcher to recover with
        if isinstance(exc, ConfigError):
            return False  # a replay would raise it again: it ends the script (run_script.py)
        recover_from(self._member, self.index, exc)
        return True


def _skip(*args: Any, **kwargs: Any) -> None:
    """An optimizer's or scheduler's step() before a degraded step's last pass."""
    return None


def _shadow_step(obj: Any) -> Callable[[], None]:
    """Make ``obj.step()`` do nothing; return what puts it back. An instance's own ``step`` (a
    scheduler wraps its optimizer's that way) is put back as it was."""
    had = "step" in obj.__dict__
    prev = obj.__dict__.get("step")
    obj.step = _skip

    def undo() -> None:
        if had:
            obj.step = prev
        else:
            obj.__dict__.pop("step", None)

    return undo
