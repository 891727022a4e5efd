"""A hand-written Accelerate loop under checkpointless: ``Accelerator`` -> ``CheckpointlessAccelerator``.

The loop stays as it is (docs/adoption.md, "Hugging Face")::

    accelerator = CheckpointlessAccelerator(gradient_accumulation_steps=2, cpu=True)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    for epoch in range(epochs):
        for batch in dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.end_training()          # every rank waits for the job's end here

- Evaluation between steps (its DataLoader prepared by ``prepare`` as accelerate does, its gathers
  on the job's group) is made a protected section with ``evaluate = accelerator.protect(evaluate)``:
  the loop calls ``evaluate()`` where it did, after each epoch's inner loop; a fault during it is
  recovered and it runs again on every rank, a replacement included. A
  replacement whose loop passes epochs its state already holds gets what it returned there. What
  it prints and logs (``accelerator.print``, ``accelerator.log``) is shown once every rank has
  left the section together.
- ``save_state``/``load_state`` are refused: the state survives faults in memory, and the launcher
  keeps the durable copies (``--checkpoint-dir``, ``--checkpoint-every``).

- The first prepared DataLoader samples with a ``DistributedSampler`` through ``job.loader``: its
  iterator yields the micro-batches of one optimizer step after another, a function of the step,
  so a replacement seeks to its step and a replay gets the very batches it had.
- One optimizer step (its ``gradient_accumulation_steps`` micro-batches, each in its
  ``accelerator.accumulate`` block) is one checkpointless ``Step``: the first block enters it, the
  last one commits it. A fault in any block is recovered there and the iterator then yields the
  step's micro-batches again.
- ``prepare`` wraps models in torch's ``DistributedDataParallel`` over the job's group, as
  accelerate does; the job resets its reducer after an abandoned step, in one bucket layout on
  every rank (comm/torch_ddp.py). The models, optimizers, schedulers and grad scaler are the
  replica.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.utils import send_to_device  # type: ignore[import-untyped]
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import checkpointless
from checkpointless.comm.torch_ddp import serve_ddp
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.integrations._hf_accelerate_data import Attempt, StepDataLoader
from checkpointless.integrations._hf_accelerate_held import HeldOutput
from checkpointless.integrations._hf_internals import warn_if_untested
from checkpointless.integrations._hf_state import ProtectedResults, micro_batches_digest
from checkpointless.recovery.job import Job, Step

__all__ = ["CheckpointlessAccelerator"]

log = get_logger()

T = TypeVar("T")


class CheckpointlessAccelerator(Accelerator):
    """An ``Accelerator`` whose training loop survives faults in process (docs/adoption.md).

    ``data_seed`` seeds the training DataLoader's shuffling; ``rendezvous_timeout`` and
    ``max_step_retries`` go to ``checkpointless.init()``; ``record_batches`` adds a digest of
    each step's micro-batches to its commit event (tests)."""

    def __init__(
        self,
        *args: Any,
        data_seed: int = 0,
        rendezvous_timeout: float = 60.0,
        max_step_retries: int = 3,
        record_batches: bool = False,
        **kwargs: Any,
    ) -> None:
        warn_if_untested()
        # before accelerate sets itself up: it then finds the job's rank and default group
        self.job: Job = checkpointless.init(
            rendezvous_timeout=rendezvous_timeout, max_step_retries=max_step_retries
        )
        # On CPU, Accelerate refuses ranks spread over several hosts unless MASTER_ADDR is set,
        # though it reads it only to form a default group, and the job formed that group already
        # (root-less: there is no rank-0 address to give). It fills in MASTER_PORT itself.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        serve_ddp(dist.group.WORLD)  # prepare()'s own DDP on the job's group (comm/torch_ddp.py)
        super().__init__(*args, **kwargs)
        self._data_seed = data_seed
        self._record_batches = record_batches
        self._objects: dict[str, Any] = {}
        self._train: StepDataLoader | None = None
        self._steps: Iterator[Step] | None = None
        self._pending: Step | None = None
        self._done = False
        self._attempt: Attempt | None = None
        self._held: tuple[int, list[Any]] | None = None
        self._results = ProtectedResults()
        self._protected: dict[str, int] = {}  # protected function -> its period in steps
        # inside a protected function: what it prints and logs, shown once its section has closed
        self._held_output = HeldOutput(self._show_print, self._show_log)

    # -- preparation ---------------------------------------------------------------------------
    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        # accelerate's own preparation: torch's DDP over the job's group, as in any Accelerate job
        prepared: nn.Module = super().prepare_model(model, device_placement, evaluation_mode)
        if evaluation_mode:
            return prepared
        ddp = prepared if isinstance(prepared, DistributedDataParallel) else None
        inner = ddp.module if ddp is not None else prepared  # the replica: the model's own names
        self._objects[f"model{sum(k.startswith('model') for k in self._objects)}"] = inner
        if ddp is not None:  # not in a job of one
            self.job.internals.tracked.add_ddp(ddp)
        log.info("the prepared model is a %s.%s", type(prepared).__module__, type(prepared).__qualname__)
        return prepared

    def prepare_optimizer(self, optimizer: Any, device_placement: bool | None = None) -> Any:
        self._objects[f"optimizer{sum(k.startswith('optimizer') for k in self._objects)}"] = optimizer
        return super().prepare_optimizer(optimizer, device_placement)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        self._objects[f"scheduler{sum(k.startswith('scheduler') for k in self._objects)}"] = scheduler
        return super().prepare_scheduler(scheduler)

    def prepare_data_loader(
        self,
        data_loader: DataLoader[Any],
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        if self._train is not None:  # evaluation data: accelerate's own (not protected)
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        self._train = StepDataLoader(
            data_loader, self.job, self.gradient_accumulation_steps, self._data_seed, self._epoch_batches
        )
        return self._train

    # -- protected evaluation ------------------------------------------------------------------
    def protect(self, fn: Callable[[], T]) -> Callable[[], T | None]:
        """``fn`` (no arguments: an evaluation over a prepared DataLoader, say) as a protected
        section at the end of every epoch. Call the returned function in the loop after the
        epoch's inner loop: ``fn`` runs there on every rank, and a fault inside it is recovered
        and ``fn`` run again. It returns ``fn``'s result; a replacement passing an epoch its state
        holds already gets the result of that epoch's run (None if there was none). Prepare the
        training DataLoader first, and call this before the loop.

        Not inside an epoch: a loop's own count of steps there also counts the replays, so its
        calls would not fall on the same boundaries as the run's without faults. For a function
        every N steps, ``accelerator.job.section(name, fn, every=N)`` runs it at those boundaries
        by itself, without a call from the loop."""
        if self._train is None:
            raise ConfigError("accelerator.protect() needs the training DataLoader: prepare it first")
        if self._steps is not None:
            raise ConfigError("accelerator.protect() must be called before the training loop starts")
        period = self._train.plan.steps_per_epoch
        name = f"accelerate:{getattr(fn, '__name__', 'fn')}:{len(self._protected)}"
        self._protected[name] = period

        def run() -> None:
            self._held_output.begin()  # an interrupted attempt's lines are not shown
            self._results.put(name, self.job.committed_step, fn())

        # as job.section(name, run, every=period), with the lines shown as the section closes
        self.job.internals.schedule.add_section(
            name, run, period, False, closed=self._section_closed, held=self._held_output
        )
        return lambda: self._call_protected(name)

    def _section_closed(self) -> None:
        """A protected function's section has closed on every rank together (recovery/driver.py):
        no fault can make it run again, so what it printed and logged is shown now, once. A
        tracker that raises here is recovered in process and this runs again, going on from
        the line that raised (those before it are not shown twice)."""
        self._held_output.closed()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Accelerate's ``print``; inside a protected function, held until its section has
        closed on every rank (a redone evaluation prints its lines once)."""
        if not self._held_output.print(args, kwargs):
            super().print(*args, **kwargs)

    def log(
        self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Accelerate's ``log`` to the trackers; inside a protected function, held (a copy of
        ``values``) until its section has closed on every rank, so that a redone evaluation is
        recorded once."""
        if not self._held_output.log(values, step, log_kwargs):
            super().log(values, step, log_kwargs)

    def _show_print(self, text: str, flush: bool, file: Any) -> None:
        super().print(text, end="", flush=flush, file=file)

    def _show_log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any] | None) -> None:
        super().log(values, step, log_kwargs)

    def _call_protected(self, name: str) -> Any:
        loader = self._train
        assert loader is not None  # protect() required it
        if self._attempt is not None:
            raise ConfigError(
                "a protected function was called inside an epoch of the training DataLoader; call it "
                "after the epoch's inner loop (`for batch in loader: ...`), where it runs"
            )
        at = loader.loop_at
        done, result = self._results.get(name, at)
        if done or at < self.job.committed_step:
            return result  # ran here already, or a replacement passing an epoch its peers ran
        if self._pending is None:
            self._peek()  # the job's sections at this boundary run now, this one among them
        done, result = self._results.get(name, at)
        if not done:
            raise ConfigError(
                f"a protected function was called after {at} optimizer steps, which is not the end "
                f"of an epoch ({self._protected[name]} steps each); call it after the epoch's inner "
                "loop, where it runs"
            )
        return result

    # -- accelerate's own checkpoints ----------------------------------------------------------
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        raise ConfigError(
            "accelerator.save_state() is not supported by CheckpointlessAccelerator: every rank's "
            "state survives faults in memory, and durable copies are the launcher's: run with "
            "`checkpointless run --checkpoint-dir DIR --checkpoint-every N` (restored when every "
            "replica is lost). To export the weights, use accelerator.save_model(model, DIR)"
        )

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        raise ConfigError(
            "accelerator.load_state() is not supported by CheckpointlessAccelerator: a replacement "
            "receives its state from a peer, and the launcher restores its own durable checkpoints "
            "(`checkpointless run --checkpoint-dir DIR --checkpoint-every N`). To start from saved "
            "weights, load them into the model before accelerator.prepare()"
        )

    # -- the loop ------------------------------------------------------------------------------
    def _start(self, loader: StepDataLoader) -> None:
        objects = dict(self._objects)
        if self.scaler is not None:  # fp16: the loss scale and its growth tracker
            objects["grad_scaler"] = self.scaler
        if self._protected:
            objects["protected_results"] = self._results
        self.job.track(**objects)
        self._loader = self.job.loader(loader.twin)
        self._steps = self.job.steps(2**62, steps_per_epoch=loader.plan.steps_per_epoch)  # see end_training
        first = self._peek()
        if self.job.is_replacement and first is not None:
            log.info("joined at step %d; the training DataLoader seeks there", first.index)

    def _peek(self) -> Step | None:
        if self._pending is None and not self._done and self._steps is not None:
            try:
                self._pending = next(self._steps)
            except StopIteration:
                self._done = True
        return self._pending

    def _epoch_batches(self, loader: StepDataLoader, epoch: int) -> Iterator[Any]:
        if self._steps is None:
            self._start(loader)
        while True:
            step = self._peek()
            if step is None or loader.plan.epoch(step.index) > epoch:
                # the epoch is over (or the job); a replacement passes finished epochs here
                loader.loop_at = min(self.job.committed_step, (epoch + 1) * loader.plan.steps_per_epoch)
                return
            if loader.plan.epoch(step.index) < epoch:
                raise ConfigError(
                    f"the job went back to step {step.index} while the loop is in epoch {epoch}: every "
                    "replica was lost and an older state restored, which CheckpointlessAccelerator "
                    "cannot follow"
                )
            self._pending = None
            while True:
                index = step.index
                if self._held is None or self._held[0] != index:
                    micro = loader.plan.micro_batches(index)
                    self._held = (index, [self._loader.batch(i) for i in micro])
                batches = self._held[1]
                attempt = self._attempt = Attempt(step, len(batches))
                # accelerate's accumulation counter: the step's last micro-batch syncs and steps
                self.step = self.gradient_accumulation_steps - len(batches)
                for batch in batches:
                    yield send_to_device(batch, self.device)
                    if attempt.failed:
                        break
                self._attempt = None
                loader.loop_at = self.job.committed_step
                if not attempt.failed:
                    if not step.committed:
                        raise ConfigError(
                            "a micro-batch of the training DataLoader was used outside "
                            "`with accelerator.accumulate(model):`; run each one's forward, backward "
                            "and optimizer step inside that block"
                        )
                    if loader.plan.epoch(index + 1) > epoch:
                        # the epoch's last step: the next one is asked for when the next epoch
                        # starts, so that end_training() finds the job between steps
                        return
                    break
                following = self._peek()  # recovered: replay this step, or go on past it
                if following is None or following.index != index:
                    break
                self._pending = None
                step = following

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Accelerate's ``accumulate``, and the checkpointless step around the step's blocks."""
        attempt = self._attempt
        if attempt is None or attempt.failed:
            with super().accumulate(*models):
                yield
            return
        if not attempt.entered:
            # a step begins: no protected function is under way (an older state restored after
            # one was interrupted goes back to steps first), so nothing printed from here is held
            self._held_output.stop()
            attempt.step.__enter__()
            attempt.entered = True
            if self._record_batches and self._held is not None:  # the step's own (see _epoch_batches)
                self.job.record(batch=micro_batches_digest(self._held[1]))
        attempt.done += 1
        try:
            with super().accumulate(*models):
                yield
        except Exception as exc:
            attempt.failed = True
            if not attempt.step.__exit__(type(exc), exc, exc.__traceback__):
                raise  # no launcher to recover with: as without checkpointless
            return
        if attempt.done == attempt.count:
            attempt.step.__exit__(None, None, None)

    def end_training(self) -> None:
        """Wait until every rank holds the final state (recovering a rank that fails meanwhile),
        then finish the trackers. The job's process group is left to the job."""
        if self._steps is not None and not self._done:
            self.job.stop()
            pending = self._pending
            if pending is not None and not pending.entered:
                # a protected function ran this boundary's sections, which took the next step
                # from job.steps(); the loop ended before it: the job ends at the boundary, and
                # job.steps() is told the step was not skipped by mistake (job.stop() came first)
                pending.entered = True
                self._pending = None
            while self._peek() is not None:
                self._pending = None
        for tracker in self.trackers:
            tracker.finish()
