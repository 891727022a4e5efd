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

- The first prepared DataLoader samples with a ``DistributedSampler`` through ``job.loader``: its
  iterator yields the micro-batches of one optimizer step after another, a function of the step,
  so a replacement seeks to its step and a replay gets the very batches it had.
- One optimizer step (its ``gradient_accumulation_steps`` micro-batches, each in its
  ``accelerator.accumulate`` block) is one checkpointless ``Step``: the first block enters it, the
  last one commits it. A fault in any block is recovered there and the iterator then yields the
  step's micro-batches again.
- Prepared models are wrapped in the job's abortable ``DataParallel`` (after accelerate's own
  preparation, autocast included), not DDP; the models, optimizers, schedulers and grad scaler
  are the replica.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.utils import send_to_device  # type: ignore[import-untyped]
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

import checkpointless
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.integrations._hf_internals import warn_if_untested
from checkpointless.integrations._hf_state import StepPlan
from checkpointless.recovery.job import Job, Step

__all__ = ["CheckpointlessAccelerator"]

log = get_logger()


@dataclass
class _Attempt:
    """One attempt at a step: how many of its micro-batches' blocks have run, and how it ended."""

    step: Step
    count: int
    entered: bool = False
    done: int = 0
    failed: bool = False


class _StepDataLoader:
    """The training DataLoader, step-addressable: iterate it once per epoch, as the original."""

    def __init__(self, accelerator: CheckpointlessAccelerator, dl: DataLoader[Any], seed: int) -> None:
        if isinstance(dl.dataset, IterableDataset) or dl.batch_size is None:
            raise ConfigError(
                "CheckpointlessAccelerator needs a map-style dataset and a batch_size for the training "
                "DataLoader: its batches must be a function of (epoch, position)"
            )
        job = accelerator.job
        shuffle = isinstance(dl.sampler, RandomSampler)
        sampler: DistributedSampler[Any] = DistributedSampler(
            dl.dataset, num_replicas=job.world_size, rank=job.rank, shuffle=shuffle, seed=seed
        )
        self.twin: DataLoader[Any] = DataLoader(
            dl.dataset,
            batch_size=dl.batch_size,
            sampler=sampler,
            collate_fn=dl.collate_fn,
            num_workers=dl.num_workers,
            pin_memory=dl.pin_memory,
            drop_last=dl.drop_last,
        )
        self.plan = StepPlan(len(self.twin), accelerator.gradient_accumulation_steps)
        self._accelerator = accelerator
        self.epochs_started = 0

    def __len__(self) -> int:
        return len(self.twin)

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epochs_started
        self.epochs_started += 1
        return self._accelerator._epoch_batches(self, epoch)


class CheckpointlessAccelerator(Accelerator):
    """An ``Accelerator`` whose training loop survives faults in process (docs/adoption.md).

    ``data_seed`` seeds the training DataLoader's shuffling; ``rendezvous_timeout`` and
    ``max_step_retries`` go to ``checkpointless.init()``."""

    def __init__(
        self,
        *args: Any,
        data_seed: int = 0,
        rendezvous_timeout: float = 60.0,
        max_step_retries: int = 3,
        **kwargs: Any,
    ) -> None:
        warn_if_untested()
        # before accelerate sets itself up: it then finds the job's rank and default group
        self.job: Job = checkpointless.init(
            rendezvous_timeout=rendezvous_timeout, max_step_retries=max_step_retries
        )
        super().__init__(*args, **kwargs)
        self._data_seed = data_seed
        self._objects: dict[str, Any] = {}
        self._train: _StepDataLoader | None = None
        self._steps: Iterator[Step] | None = None
        self._pending: Step | None = None
        self._done = False
        self._attempt: _Attempt | None = None
        self._held: tuple[int, list[Any]] | None = None

    # -- preparation ---------------------------------------------------------------------------
    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        # accelerate's preparation without its DDP (evaluation_mode), then the job's DataParallel
        prepared: nn.Module = super().prepare_model(model, device_placement, evaluation_mode=True)
        if evaluation_mode:
            return prepared
        self._objects[f"model{sum(k.startswith('model') for k in self._objects)}"] = prepared
        return self.job.data_parallel(prepared)

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
        self._train = _StepDataLoader(self, data_loader, self._data_seed)
        return self._train

    # -- the loop ------------------------------------------------------------------------------
    def _start(self, loader: _StepDataLoader) -> None:
        objects = dict(self._objects)
        if self.scaler is not None:  # fp16: the loss scale and its growth tracker
            objects["grad_scaler"] = self.scaler
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

    def _epoch_batches(self, loader: _StepDataLoader, epoch: int) -> Iterator[Any]:
        if self._steps is None:
            self._start(loader)
        while True:
            step = self._peek()
            if step is None or loader.plan.epoch(step.index) > epoch:
                return  # the epoch is over (or the job); a replacement passes finished epochs here
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
                attempt = self._attempt = _Attempt(step, len(batches))
                # accelerate's accumulation counter: the step's last micro-batch syncs and steps
                self.step = self.gradient_accumulation_steps - len(batches)
                for batch in batches:
                    yield send_to_device(batch, self.device)
                    if attempt.failed:
                        break
                self._attempt = None
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
            attempt.step.__enter__()
            attempt.entered = True
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
            while self._peek() is not None:
                self._pending = None
        for tracker in self.trackers:
            tracker.finish()
