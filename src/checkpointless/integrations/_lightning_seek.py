"""A replacement's catch-up in Lightning's fit loop as a seek, not a walk from batch 0.

A replacement receives a replica's state for job step C while Lightning's loop on its process
stands at the fit's first batch. Walking the loop forward to C (``training_step`` skipped) reads
every batch before C through the DataLoader: at step 100,000 a full pass over the data before
the job can go on. Instead, for the usual training data (map-style DataLoaders whose order is a
function of the epoch: the ``DistributedSampler`` Lightning injects, or a ``SequentialSampler``;
one, or several that Lightning combines) the replacement puts the loop where an uninterrupted run
has it as step C's first batch begins:

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
  epoch's start). With several loaders each starts at its own batch: in Lightning's default
  ``max_size_cycle`` mode a shorter one is started again as it runs out (in the same order: its
  epoch is the same), so it is at the batch modulo its length; in ``max_size`` one that ran out
  stays so; in ``min_size`` none runs out;
- in a fit that validates, the validation loop's counters are an uninterrupted run's too. Which
  batches end in a validation follows from the batch alone (``val_check_batch``, per epoch or over
  the fit when ``check_val_every_n_epoch`` is None, in the epochs it allows), so the runs before
  C are counted, not repeated: the epoch's total counts each run's batches (Lightning resets it as
  an epoch begins), and the last run's count stays in ``current``. The validations before C are
  not run again (their metrics do not change the weights; ``trainer.callback_metrics`` lacks
  them until the next validation, as it lacks the training metrics of the steps before C).

- ``ReduceLROnPlateau`` schedulers: their state travels as any scheduler's, and their calls are
  counted as the other schedulers' are, which is exact for ``strict=True`` (a call whose metric is
  missing stops the fit, so every call of a fit that goes on had it and counted). Lightning calls
  one with the last value of its metric, which may be a validation's before C: those values
  travel with the replica (``_lightning_state.PlateauMetrics``), since the seek runs no validation.
- ``fit(ckpt_path=...)``: the replacement restores the checkpoint as every process did, and the
  position of C is counted from the checkpoint's, in the resumed fit, which reads its first epoch
  from the DataLoader's first batch and whose counters are Lightning's restart of the
  checkpoint's (see :func:`seek`).

Anything else is refused by :func:`seek_refusal` with the reason, and the strategy walks the
loop as before, saying so: an iterable dataset, a sampler whose order depends on more than the
epoch, validation on a time interval or from a loader without a length,
reloaded dataloaders, a ``ReduceLROnPlateau(strict=False)`` (Lightning skips a call whose metric is
missing without counting it: the count follows the fit's history, not its position), and a fit
resumed from a checkpoint whose restart Lightning runs as a loop iteration of its own (written as
an epoch began or ended in a fit bounded by ``max_steps``, or after the validation of an epoch's
last batch), written during a validation, or after one in a fit with a plateau scheduler called
every few batches (the restart runs that batch's end again, and that call with it), whose loop is
not where its step is in this fit's epochs, or with a stateful DataLoader. The attribute paths are Lightning 2.6's,
as in ``_lightning_internals``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from checkpointless.integrations._lightning_resumed import (
    counters,
    epoch_lags,
    leave_first_epoch,
    move_counters,
    plateau_steps_at_end_of,
    restart_refusal,
    restarted_counters,
)

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
        why = _resume_refusal(trainer)
        if why is not None:
            return why
    if trainer.reload_dataloaders_every_n_epochs:
        return "the training DataLoader is reloaded every few epochs"
    if trainer.enable_validation:
        why = _validation_refusal(trainer)
        if why is not None:
            return why
    if any(cfg.reduce_on_plateau and not cfg.strict for cfg in trainer.lr_scheduler_configs):
        # a strict one either finds its metric at every call Lightning counts, or stops the fit
        return (
            "a ReduceLROnPlateau with strict=False: Lightning neither steps nor counts a call whose "
            "metric is missing, which only the fit's history tells"
        )
    per_epoch = trainer.num_training_batches
    if not isinstance(per_epoch, int) or per_epoch <= 0:
        return "the training data has no length (an iterable dataset)"
    for loader in _loaders(trainer):
        why = _loader_refusal(loader)
        if why is not None:
            return why
    if type(trainer.fit_loop._data_fetcher).__name__ == "_DataLoaderIterDataFetcher":
        return "training_step takes the dataloader_iter"
    return None


def _loaders(trainer: Any) -> list[Any]:
    """The training loaders (several in a ``CombinedLoader``, or given as a list or dict)."""
    return list(trainer.fit_loop._combined_loader.flattened)


def _loader_refusal(loader: Any) -> str | None:
    if not isinstance(loader, DataLoader):
        return f"the training data is {type(loader).__name__}, not a DataLoader"
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
    return None


def _skips(trainer: Any, batch: int) -> list[int]:
    """The batches each training loader's next iterator skips so that the fit's loaders stand at
    its ``batch``: a ``CombinedLoader`` in Lightning's default ``max_size_cycle`` mode starts a
    shorter loader again when it runs out (the same order: its epoch is the same), so it is at
    ``batch`` modulo its length; in ``max_size`` one that ran out stays so; in ``min_size`` none
    runs out within an epoch."""
    mode = trainer.fit_loop._combined_loader._mode
    out = []
    for loader in _loaders(trainer):
        n = len(loader)
        out.append(batch % n if mode == "max_size_cycle" else min(batch, n))
    return out


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


def _resume_refusal(trainer: Any) -> str | None:
    """Why a fit resumed from a checkpoint cannot be sought (None: it can)."""
    why = restart_refusal(trainer, _loaders(trainer))
    if why is not None:
        return why
    manual = not trainer.lightning_module.automatic_optimization
    if _checkpoint_position(trainer, manual) is None:
        return (
            "the fit resumed from a checkpoint whose loop is not where its step is in epochs of "
            f"{trainer.num_training_batches} batches (another length, accumulation, or mid-update)"
        )
    return None


def _checkpoint_position(trainer: Any, manual: bool) -> FitPosition | None:
    """Where the restored checkpoint's step begins, if its loop is there (batches of the fit
    before it) as in a fit of this one's epochs; None if not."""
    done = int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
    pos = fit_position(trainer, done if manual else int(trainer.global_step), manual)
    return pos if pos.batches == done else None


def seek(trainer: Any, pos: FitPosition, manual: bool) -> None:
    """Put the fit loop (called from ``on_train_start``, before its first epoch begins) at
    ``pos``: the counters an uninterrupted run has there, and the DataLoader's next iterator at
    the batch. :func:`seek_refusal` must have returned None.

    A fit resumed from a checkpoint (``fit(ckpt_path=...)``) starts at the checkpoint's step S in
    epoch E, at batch b of it, and reads E from the DataLoader's first batch (a plain DataLoader
    keeps no position): its batch b + i is the loader's batch i, and so a step of E is b batches
    fewer into the loader than in a fit from batch 0; later epochs are read whole. Its counters are
    Lightning's restart of the checkpoint's (which is not always a fit from 0's: an epoch's count
    one behind after a checkpoint of an epoch's last batch, a scheduler call lost): they are taken
    as Lightning's restart leaves them and moved on by what a fit from 0 counts between S and
    ``pos``; and its fit loop keeps its restart mark until E ends, which skips the plateau
    schedulers' step at E's end."""
    from lightning.pytorch.loops.fit_loop import RestartStage

    fit = trainer.fit_loop
    start = _checkpoint_position(trainer, manual) if trainer.ckpt_path is not None else None
    first = start is not None and start.epoch == pos.epoch  # in the resumed fit's first epoch
    in_epoch = 1 if pos.batch else 0  # mid-epoch, the epoch has begun and its hooks have run
    lags = epoch_lags(fit, start.epoch) if start is not None else {}
    for name, tracker in (("total", fit.epoch_progress.total), ("current", fit.epoch_progress.current)):
        lag = lags.get(name, {})
        tracker.ready = pos.epoch + in_epoch - lag.get("ready", 0)
        tracker.started = pos.epoch + in_epoch - lag.get("started", 0)
        tracker.processed = pos.epoch - lag.get("processed", 0)
        tracker.completed = pos.epoch - lag.get("completed", 0)
    skipped = 0  # plateau schedulers' steps the resumed fit skips at its first epoch's end
    if start is not None and not first:
        if fit.restarting:
            skipped = plateau_steps_at_end_of(trainer, start.epoch)
        leave_first_epoch(fit)
    # Lightning's own mark for a fit resumed inside an epoch: the epoch is not begun again
    # (its hooks and counters), but its samplers get their epoch; cleared after the epoch
    fit._restart_stage = RestartStage.RESTARTED_MID_EPOCH if pos.batch else RestartStage.NONE
    # the loaders' batch (a resumed fit reads its first epoch from the loaders' first)
    skips = _skips(trainer, pos.batch - (start.batch if first and start is not None else 0))
    for loader, n in zip(_loaders(trainer), skips, strict=True):
        if n:
            _SkipBatches.install(loader, n)
    skip = any(skips)
    loop = fit.epoch_loop

    def reset_then_place() -> None:
        # the epoch loop resets its per-epoch counters as each epoch starts (a resumed fit's
        # first, with its restart's): set them after
        del loop.reset  # Lightning's own from now on
        loop.reset()
        if start is None:
            _place(trainer, pos, manual)
        else:
            _place_resumed(trainer, start, pos, manual, first, skipped)
        if skip and not (trainer.current_epoch > 0 and not fit.is_resuming and not loop.restarting):
            # the fit made this epoch's iterator before it started; on_run_start makes the others
            iter(fit._data_fetcher)

    loop.reset = reset_then_place


def _place_resumed(
    trainer: Any, start: FitPosition, pos: FitPosition, manual: bool, first: bool, skipped: int
) -> None:
    """The resumed fit's counters at ``pos`` (``_lightning_resumed``), as its restart has just
    left them at ``start``."""
    loop = trainer.fit_loop.epoch_loop
    base = restarted_counters(loop)
    _place(trainer, start, manual)
    at_start = counters(loop)
    _place(trainer, pos, manual)
    move_counters(loop, base, at_start, counters(loop), first, skipped)


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
