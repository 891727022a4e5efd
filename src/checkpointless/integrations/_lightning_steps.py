"""The job's steps as Lightning's optimizer steps, gradient accumulation included.

A job step is one optimizer update: with ``Trainer(accumulate_grad_batches=N)`` it is a *window*
of N micro-batches (fewer at an epoch's end, where Lightning always steps). The strategy asks
Lightning to hand it every micro-batch (``handles_gradient_accumulation``), so each one reaches
:meth:`LightningSteps.micro_batch` with its closure (``training_step``, ``zero_grad`` on the
window's first, backward):

- The window's first micro-batch enters the job's step; it stays open across Lightning's loop
  between micro-batches and commits after the last one's update. The micro-batches before the
  last accumulate their gradients locally (``DataParallel.local_backward``); the last one's
  backward all-reduces the sum, so a window has the collectives of one step.
- A fault in any micro-batch (this rank's exception, or the all-reduce aborted by another rank's
  fault) leaves the step to the recovery; the window is then trained again from its first
  micro-batch, by running the closures this rank kept of it. Lightning's loop never goes back:
  the batches are those it handed in, the generators are the step's (the recovery puts them
  back as the step began), and what the closures count or log again is put back first (the
  ``zero_grad`` count, the ``on_epoch`` sums, callbacks with hooks inside the closure).
- A replacement holds a replica's state as a window began, and Lightning's loop starts at batch
  0: it walks past every micro-batch of the windows the state holds (``training_step`` skipped)
  and trains from the first micro-batch of the window its state is at.

Under manual optimization (``automatic_optimization = False``) a job step is one batch's
``training_step``, with whatever optimizer steps it makes (:meth:`LightningSteps.manual_step`;
a GAN's two, say, each after its own backward and all-reduce). A fault between two of them
leaves every rank with some updates applied and others not, a state of no step: so the state the
step began with (weights, optimizers, schedulers) is copied as it begins, and a rank that faults
after an update puts it back before the recovery, which then finds it whole at the step's start
(or rolls it forward to a peer that committed the step).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from checkpointless.events import get_logger
from checkpointless.integrations._lightning_callbacks import CallbackReplica
from checkpointless.integrations._lightning_internals import (
    EpochMetricsMark,
    ProgressMark,
    batch_count,
    updates_now,
)
from checkpointless.integrations._lightning_state import BatchAction, batch_action
from checkpointless.recovery.job import Job, Step
from checkpointless.state.snapshot import RngState, capture_rng, restore_rng

__all__ = ["LightningSteps"]

log = get_logger()


class LightningSteps:
    """Drives ``job.steps()`` one optimizer step (one window of micro-batches) at a time.

    ``update`` applies the optimizer step through Lightning's precision plugin, given the last
    micro-batch's closure result; ``local_backward`` is the model wrapper's (None: one rank).
    ``manual``: under manual optimization, the tracked objects a step's updates change, to be put
    back as the step began when it faults after one of them. ``start``: the updates in the state
    the fit began with (a checkpoint's, ``fit(ckpt_path=...)``)."""

    def __init__(
        self,
        job: Job,
        trainer: Any,
        callbacks: CallbackReplica | None,
        local_backward: Callable[[], AbstractContextManager[None]] | None,
        manual: dict[str, Any] | None = None,
        start: int = 0,
    ) -> None:
        self._job = job
        self._trainer = trainer
        self._callbacks = callbacks
        self._local_backward = local_backward
        self.done = False  # the generator ended: every rank holds the final state
        self.inside = False  # running a micro-batch's closure or the update: collectives are real
        self.skipping = False  # training_step is skipped: a batch the state already holds
        self._steps = job.steps(2**62, start)  # Lightning decides the end; see finish()
        self._pending = self._next_step()  # taken from the generator, not yet entered
        # a replacement's generators as its next step began: restored when this rank reaches that
        # step, because walking Lightning's loop there may draw from them
        self._catch_up_rng: RngState | None = capture_rng() if job.is_replacement else None
        # a replacement's catch-up is timed from here: wall clock, and this process's CPU (which a
        # machine shared with other work leaves nearly as it is)
        self._joined_at = (time.perf_counter(), time.process_time())
        self._open: Step | None = None  # the window's step, entered and not yet left
        self._closures: list[Callable[[], Any]] = []  # the open window's micro-batches, in order
        self._marks: tuple[ProgressMark, EpochMetricsMark] | None = None
        self._manual = manual
        self._at_start: dict[str, Any] | None = None  # a manual step's state as it began

    @property
    def catching_up(self) -> bool:
        """A replacement that has not reached the step of the state it received."""
        return self._catch_up_rng is not None

    def _next_step(self) -> Step | None:
        try:
            step: Step = next(self._steps)
            return step
        except StopIteration:
            self.done = True
            return None

    def _skips(self, lightning_step: int) -> bool:
        return self.done or batch_action(lightning_step, self._job.committed_step) is BatchAction.SKIP

    def micro_batch(self, closure: Callable[[], Any], update: Callable[[Any], Any]) -> Any:
        """Lightning's optimizer step for one batch: an accumulating micro-batch, or the update."""
        lightning_step = self._trainer.global_step
        updates = updates_now(self._trainer)
        callbacks = self._callbacks
        if callbacks is not None:
            callbacks.at(lightning_step)
        this_batch = ProgressMark(self._trainer)  # what this call's closure has not counted yet
        first = self._open is None  # the window's first micro-batch
        if first and (self._skips(lightning_step) or not self._enter(lightning_step, replay=False)):
            return self._skip(closure, lightning_step)
        self._closures.append(closure)
        run = [closure]
        while True:
            recovered, out = self._attempt(run, updates, update)
            if not recovered:
                return out
            # the job now stands at the step it settled on: train the window again from its
            # first micro-batch, or skip the batch if its update is in this rank's state already
            if callbacks is not None:
                callbacks.rewind()
            if self._skips(lightning_step):
                # rolled forward past the window: its micro-batches each ran once, and the skip
                # runs this one's closure again, so only its own count is put back
                this_batch.restore()
                return self._skip(closure, lightning_step)
            if self._marks is not None:
                self._marks[0].restore()  # every closure of the window runs again: count them once
            if not self._enter(lightning_step, replay=True):
                return self._skip(closure, lightning_step)
            run = list(self._closures)

    def manual_step(self, run: Callable[[], Any]) -> Any:
        """A manual ``training_step`` (``run``) as the job's step: trained, trained again after a
        recovery, or skipped (None) where this rank's state holds its updates already."""
        batch = batch_count(self._trainer)
        if self._callbacks is not None:
            self._callbacks.at(batch)
        if self._skips(batch) or not self._enter(batch, replay=False):
            return self._pass(batch)
        while True:
            step = self._open
            assert step is not None
            self.inside = True
            try:
                out = run()
            except BaseException as e:
                self.inside = False
                self._open = None
                self._undo_updates()
                if not step.__exit__(type(e), e, e.__traceback__):
                    raise
            else:
                self.inside = False
                self._open = None
                self._at_start = None
                step.__exit__(None, None, None)  # commits
                return out
            finally:
                self.inside = False
            if self._callbacks is not None:
                self._callbacks.rewind()
            if self._skips(batch):
                # rolled forward: the step count came with the state it received (a rank never
                # rolls forward by itself here: its own updates were put back)
                return self._pass(batch)
            if self._marks is not None:
                self._marks[0].restore()  # the optimizer steps of the attempt count once
            if not self._enter(batch, replay=True):
                return self._pass(batch)

    def _undo_updates(self) -> None:
        """Put back the state the manual step began with if the attempt updated any of it."""
        saved, self._at_start = self._at_start, None
        guard = self._job.internals.guard
        if saved is None or self._manual is None or not (guard.updated or guard.dirty):
            return
        for name, state in saved.items():
            self._manual[name].load_state_dict(state)
        guard.updated = guard.dirty = False  # whole again, as the step began

    def _pass(self, batch: int) -> None:
        """A manual step this rank's state holds already: its training_step does not run."""
        if self._callbacks is not None:
            self._callbacks.passed(batch)

    def _enter(self, lightning_step: int, replay: bool) -> bool:
        """Enter the step of the window beginning at ``lightning_step``; False: the job ended."""
        callbacks = self._callbacks
        if replay and self._marks is not None:
            # the window trains and logs again: its on_epoch values count once (a rank rolled
            # forward past it keeps what its attempt logged)
            self._marks[1].restore()
        if not replay:
            self._marks = (ProgressMark(self._trainer), EpochMetricsMark(self._trainer))
            if callbacks is not None and self._trainer.accumulate_grad_batches > 1:
                callbacks.window_begins()
        if self._catch_up_rng is not None:
            restore_rng(self._catch_up_rng)
            self._catch_up_rng = None
            log.info(
                "caught up with step %d in %.6f s (%.6f s CPU)",
                self._job.committed_step,
                time.perf_counter() - self._joined_at[0],
                time.process_time() - self._joined_at[1],
            )
        if callbacks is not None:
            callbacks.train(lightning_step)
        step = self._pending if self._pending is not None else self._next_step()
        self._pending = None
        if step is None:  # the job ended (it cannot while Lightning still steps; skip safely)
            return False
        if self._manual is not None:  # as the step begins: what a fault after an update puts back
            self._at_start = {name: copy.deepcopy(obj.state_dict()) for name, obj in self._manual.items()}
        step.__enter__()
        self._open = step
        return True

    def _attempt(
        self, closures: list[Callable[[], Any]], updates: bool, update: Callable[[Any], Any]
    ) -> tuple[bool, Any]:
        """Run ``closures`` (the last with the all-reduce when it ends the window) and the update
        in the open step; (True, None) when a fault was recovered instead."""
        step = self._open
        assert step is not None
        out: Any = None
        self.inside = True
        try:
            result: Any = None
            for i, closure in enumerate(closures):
                with self._accumulating(not (updates and i == len(closures) - 1)):
                    # training_step and backward before optimizer.step(): the optimizer's
                    # pre-hook marks the state as mid-update, and a fault in the forward pass
                    # must leave it valid
                    result = closure()
            if updates:
                out = update(result)
        except BaseException as e:
            self.inside = False
            self._open = None
            if not step.__exit__(type(e), e, e.__traceback__):
                raise
            return True, None
        finally:
            self.inside = False
        if updates:
            self._open = None
            self._closures = []
            step.__exit__(None, None, None)  # commits
            if self._callbacks is not None:
                self._callbacks.window_ends()
        return False, out

    def _accumulating(self, local: bool) -> AbstractContextManager[None]:
        if local and self._local_backward is not None:
            return self._local_backward()
        return nullcontext()

    def _skip(self, closure: Callable[[], Any], lightning_step: int) -> None:
        # Lightning's closure must still run once (its result is read after the step), but with
        # training_step returning a detached zero it does no forward, no collective, no update
        self._closures = []
        self.skipping = True
        try:
            closure()
        finally:
            self.skipping = False
        if self._callbacks is not None:
            self._callbacks.window_ends()  # a window rolled past: the state is its own again
            self._callbacks.passed(lightning_step)

    def finish(self) -> None:
        """Lightning's fit is over on this rank: every rank ends at the same batch (max_steps,
        max_epochs); the job's end waits until all hold the final state, recovering a rank that
        fails meanwhile."""
        if self.done:
            return
        if self._callbacks is not None:
            # every hook of the fit has reached the callbacks: a replacement sent their state now
            # must not let its own walk's hooks reach them again
            self._callbacks.at(self._trainer.global_step)
        self._job.stop()
        while not self.done:
            self._next_step()
