"""A replacement's catch-up in Lightning's fit loop as a seek, not a walk from batch 0.

A replacement receives a replica's state for job step C while Lightning's loop on its process
stands at the fit's first batch. Walking the loop forward to C (``training_step`` skipped) reads
every batch before C through the DataLoader: at step 100,000 a full pass over the data before
the job can go on. Instead, for the usual training data (one map-style DataLoader whose order is
a function of the epoch: the ``DistributedSampler`` Lightning injects, or a ``SequentialSampler``)
the replacement puts the loop where an uninterrupted run has it as step C's first batch begins:

- the position follows from C alone: ``u = ceil(batches per epoch / accumulate_grad_batches)``
  updates per epoch (Lightning always steps on an epoch's last batch), so C is batch
  ``(C % u) * accumulate_grad_batches`` of epoch ``C // u`` (under manual optimization a step is
  one batch);
- Lightning's counters are set to what that run's are between batches: the epoch progress, the
  batch progress (over the fit and in the epoch), the optimizer-step and ``zero_grad`` counts, the
  scheduler updates, and the batches that stepped (the loggers' step). Manual optimization's step
  count is part of the replica already (``ManualStepCount``);
- the DataLoader's next iterator starts at the batch: its batch sampler is iterated from the
  epoch's start and the index lists before the position are dropped, so no sample before it is
  read or collated (``set_epoch`` is Lightning's, for the position's epoch, as it is at every
  epoch's start);
- in a fit that validates, the validation loop's counters are an uninterrupted run's too. Which
  batches end in a validation follows from the batch alone (``val_check_batch``, per epoch or over
  the fit when ``check_val_every_n_epoch`` is None, in the epochs it allows), so the runs before
  C are counted, not repeated: the epoch's total counts each run's batches (Lightning resets it as
  an epoch begins), and the last run's count stays in ``current``. The validations before C are
  not run again (their metrics do not change the weights; ``trainer.callback_metrics`` lacks
  them until the next validation, as it lacks the training metrics of the steps before C).

Anything else (an iterable dataset, a sampler whose order depends on more than the epoch, several
training loaders, validation on a time interval or from a loader without a length,
``fit(ckpt_path=...)``, plateau schedulers, reloaded dataloaders) is refused by
:func:`seek_refusal` with the reason, and the strategy walks the loop as before, saying so. The
attribute paths are Lightning 2.6's, as in ``_lightning_internals``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

__all__ = ["FitPosition", "fit_position", "seek", "seek_refusal"]


@dataclass(frozen=True)
class FitPosition:
    """Where job step ``step`` begins in Lightning's fit loop."""

    step: int
    epoch: int
    batch: int  # inside the epoch
    batches: int  # of the fit before it
    window: int  # updates (windows of accumulate_grad_batches) done in the epoch before it


def fit_position(trainer: Any, step: int, manual: bool) -> FitPosition:
    """The position of job step ``step`` (an optimizer update; a batch under manual
    optimization) in a fit that began at batch 0, with ``trainer.num_training_batches`` per epoch."""
    per_epoch = int(trainer.num_training_batches)
    if manual:
        epoch, batch = divmod(step, per_epoch)
        return FitPosition(step, epoch, batch, step, batch)
    accumulate = int(trainer.accumulate_grad_batches)
    epoch, window = divmod(step, math.ceil(per_epoch / accumulate))
    batch = window * accumulate
    return FitPosition(step, epoch, batch, epoch * per_epoch + batch, window)


def seek_refusal(trainer: Any) -> str | None:
    """Why this fit's loop cannot be put at a step without walking it (None: it can)."""
    if trainer.ckpt_path is not None:
        return "the fit resumed from a checkpoint (fit(ckpt_path=...))"
    if trainer.reload_dataloaders_every_n_epochs:
        return "the training DataLoader is reloaded every few epochs"
    if trainer.enable_validation:
        why = _validation_refusal(trainer)
        if why is not None:
            return why
    if any(cfg.reduce_on_plateau for cfg in trainer.lr_scheduler_configs):
        return "a ReduceLROnPlateau scheduler steps on metrics only a walk would log"
    per_epoch = trainer.num_training_batches
    if not isinstance(per_epoch, int) or per_epoch <= 0:
        return "the training data has no length (an iterable dataset)"
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        return f"the training data is {type(loader).__name__}, not one DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return f"the dataset {type(loader.dataset).__name__} is iterable"
    batches = loader.batch_sampler
    if type(batches) is not BatchSampler:
        return f"the batch sampler {type(batches).__name__} is not torch's BatchSampler"
    if type(batches.sampler) not in (DistributedSampler, SequentialSampler):
        return (
            f"the sampler {type(batches.sampler).__name__} is not addressable by epoch "
            "(DistributedSampler or SequentialSampler)"
        )
    if type(trainer.fit_loop._data_fetcher).__name__ == "_DataLoaderIterDataFetcher":
        return "training_step takes the dataloader_iter"
    return None


def _validation_refusal(trainer: Any) -> str | None:
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return (
            "the fit validates on a time interval (val_check_interval as a duration), which follows the clock"
        )
    val = trainer.fit_loop.epoch_loop.val_loop
    # what the fit's first validation (or its sanity check) does: build the loaders and count
    # their batches; the strategy's barrier in it waits for nobody (a replacement joins alone)
    val.setup_data()
    if not all(isinstance(n, int) for n in trainer.num_val_batches):
        return "a validation DataLoader has no length (an iterable dataset)"
    return None


def seek(trainer: Any, pos: FitPosition, manual: bool) -> None:
    """Put the fit loop (called from ``on_train_start``, before its first epoch begins) at
    ``pos``: the counters an uninterrupted run has there, and the DataLoader's next iterator at
    the batch. :func:`seek_refusal` must have returned None."""
    from lightning.pytorch.loops.fit_loop import RestartStage

    fit = trainer.fit_loop
    in_epoch = 1 if pos.batch else 0  # mid-epoch, the epoch has begun and its hooks have run
    for tracker in (fit.epoch_progress.total, fit.epoch_progress.current):
        tracker.ready = tracker.started = pos.epoch + in_epoch
        tracker.processed = tracker.completed = pos.epoch
    if pos.batch:
        # Lightning's own mark for a fit resumed inside an epoch: the epoch is not begun again
        # (its hooks and counters), but its samplers get their epoch; cleared after the epoch
        fit._restart_stage = RestartStage.RESTARTED_MID_EPOCH
        _SkipBatches.install(trainer.train_dataloader, pos.batch)
    loop = fit.epoch_loop

    def reset_then_place() -> None:
        # the epoch loop resets its per-epoch counters as each epoch starts: set them after
        del loop.reset  # Lightning's own from now on
        loop.reset()
        _place(trainer, pos, manual)
        if pos.epoch == 0 and pos.batch:
            # the fit made epoch 0's iterator before it started; later epochs make theirs here
            iter(fit._data_fetcher)

    loop.reset = reset_then_place


def _place(trainer: Any, pos: FitPosition, manual: bool) -> None:
    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress
    _fill(progress.total, pos.batches)
    _fill(progress.current, pos.batch)
    progress.is_last_batch = False
    # each update counted once at the window's end, the loggers' step too
    loop._batches_that_stepped = pos.step
    _place_validation(trainer, pos)
    if manual:
        return  # the optimizer steps came with the replica; no scheduler steps by Lightning
    optimizer = loop.automatic_optimization.optim_progress.optimizer
    for counter in (optimizer.step, optimizer.zero_grad):  # zero_grad: once per window
        _fill(counter.total, pos.step)
        _fill(counter.current, pos.window)
    in_epoch = _scheduler_steps(trainer, pos.batch, epoch_ends=False)
    whole = _scheduler_steps(trainer, int(trainer.num_training_batches), epoch_ends=True)
    per_epoch = [cfg.frequency for cfg in trainer.lr_scheduler_configs if cfg.interval == "epoch"]
    total = pos.epoch * whole + sum(pos.epoch // f for f in per_epoch) + in_epoch
    _fill(loop.scheduler_progress.total, total)
    _fill(loop.scheduler_progress.current, in_epoch)


def _validations_before(trainer: Any, pos: FitPosition) -> tuple[int, int]:
    """(validations the fit ran before ``pos``, those of them in ``pos``'s epoch): Lightning's
    check after each batch, ``(i + 1) % val_check_batch == 0`` for the batch's index ``i`` in its
    epoch, or over the fit when ``check_val_every_n_epoch`` is None, in the epochs it allows."""
    if not trainer.enable_validation:
        return 0, 0
    every = trainer.check_val_every_n_epoch
    k = int(trainer.val_check_batch)
    if every is None:
        before = pos.batches // k
        return before, before - (pos.batches - pos.batch) // k
    in_epoch = pos.batch // k if (pos.epoch + 1) % every == 0 else 0
    # epochs e < pos.epoch with (e + 1) % every == 0, each with per_epoch // k validations
    return (pos.epoch // every) * (int(trainer.num_training_batches) // k) + in_epoch, in_epoch


def _place_validation(trainer: Any, pos: FitPosition) -> None:
    runs, in_epoch = _validations_before(trainer, pos)
    if runs == 0:
        return
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    batches = int(sum(trainer.num_val_batches))  # over every validation loader, as Lightning counts
    _fill(progress.total, in_epoch * batches)
    _fill(progress.current, batches)
    progress.is_last_batch = True


def _scheduler_steps(trainer: Any, batches: int, epoch_ends: bool) -> int:
    """Updates of the step-interval schedulers over an epoch's first ``batches`` batches: after
    each window (and the epoch's last batch when it ``epoch_ends``) whose batch count is a
    multiple of the scheduler's frequency."""
    accumulate = int(trainer.accumulate_grad_batches)
    count = 0
    for cfg in trainer.lr_scheduler_configs:
        if cfg.interval != "step":
            continue
        count += batches // math.lcm(accumulate, cfg.frequency)
        if epoch_ends and batches % accumulate and batches % cfg.frequency == 0:
            count += 1  # the short last window of the epoch
    return count


def _fill(tracker: Any, n: int) -> None:
    for name in ("ready", "started", "processed", "completed"):
        if hasattr(tracker, name):
            setattr(tracker, name, n)


class _SkipBatches:
    """The DataLoader's batch sampler for one iterator that starts ``skip`` batches in: the
    index lists before it are drawn and dropped, never read. It takes itself off the loader as
    that iterator is made; an iterator keeping it (persistent workers) sees the plain order from
    its next epoch on."""

    def __init__(self, loader: DataLoader[Any], skip: int) -> None:
        self._loader = loader
        self._inner: BatchSampler = loader.batch_sampler  # type: ignore[assignment]
        self._skip = skip
        self.sampler = self._inner.sampler  # where Lightning calls set_epoch
        self.batch_size = self._inner.batch_size
        self.drop_last = self._inner.drop_last

    @classmethod
    def install(cls, loader: DataLoader[Any], skip: int) -> None:
        # DataLoader refuses a new batch_sampler once built; this one is its own for one iterator
        object.__setattr__(loader, "batch_sampler", cls(loader, skip))
        loader._iterator = None  # persistent workers: a new iterator, which takes this sampler

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0
        if self._loader.batch_sampler is self:
            object.__setattr__(self._loader, "batch_sampler", self._inner)
        return itertools.islice(iter(self._inner), skip, None)

    def __len__(self) -> int:
        return len(self._inner)
