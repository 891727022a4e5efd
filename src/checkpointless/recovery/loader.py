"""Make an ordinary ``torch.utils.data.DataLoader`` step-addressable.

A recoverable loop asks for "the batch of step s", never "the next batch": a replayed step must
get the batch it had, and a replacement must start where its predecessor was. A DataLoader over a
map-style dataset whose sampler order is a function of the epoch (``DistributedSampler`` and any
sampler with ``set_epoch``, or ``SequentialSampler``) can answer that by index arithmetic:

    epoch, position = divmod(step, batches_per_epoch)

:class:`StepLoader` keeps one live iterator of a twin DataLoader (same dataset, collate function,
workers, prefetch, pinning) whose batch sampler is a view that starts at ``position``. Going on to
the next step just takes the next batch, so workers and prefetch work as usual. A replay returns
the batch it already holds. A seek (a replacement, or a snapshot restore) restarts the iterator at
the new position: the skipped batches' *indices* are generated and dropped, but no sample before
the position is read.

The twin's worker seeds come from a generator seeded from the epoch alone, not from the global
torch generator, so making an iterator (which a replacement does at another step than the
survivors) never moves the training step's random numbers. Without workers the batch is read in
this process on the global generators, seeded per step for the read (``rng.batch_rng``).

Degraded mode (docs/fault-model.md): a process that holds a lost rank's data-parallel slot trains
that slot's micro-batch in an extra pass of each step. ``batch(step)`` in that pass returns the
slot's batch, not this rank's: a second reader whose sampler is a copy of this rank's with
``rank`` set to the slot, and whose iterator, workers and seeds are the ones that rank's own
loader would have had (the same epoch view and epoch-seeded worker generator). So a script that
calls ``loader.batch(step.index)`` (or reads ``step.batch``) trains every slot's batch unchanged.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from checkpointless.errors import ConfigError
from checkpointless.recovery.rng import batch_rng

__all__ = ["StepLoader"]

# mixes the epoch into the twin loader's worker-seed generator; any fixed odd constant works
_EPOCH_SEED_MIX = 0x9E3779B97F4A7C15


class _EpochView:
    """A batch sampler over the user's batch sampler, for one epoch, from a batch offset.

    The DataLoader iterates it in the main process and hands index lists to its workers, so
    setting ``epoch``/``start`` before each ``iter(loader)`` is all a seek needs.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = sampler
        self.epoch = 0
        self.start = 0

    def __iter__(self) -> Iterator[list[int]]:
        for obj in (self.sampler, self.batch_sampler):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
        # index arithmetic only: skipping draws index lists, it never touches the dataset
        return itertools.islice(iter(self.batch_sampler), self.start, None)

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.start  # type: ignore[arg-type]


class StepLoader:
    """``batch(step)`` for a DataLoader: the same batch for the same step on every run.

    Build it with :meth:`checkpointless.Job.loader` (or directly). ``dp_rank``/``dp_size``, when
    given, are checked against a ``DistributedSampler``'s ``rank``/``num_replicas``. ``slot_of``
    (the job's): the data-parallel slot whose pass is running, None for this rank's own; another
    slot's batches come from a reader of that slot's share (degraded mode).
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        slot_of: Callable[[], int | None] | None = None,
    ) -> None:
        if not isinstance(loader, DataLoader):
            raise ConfigError(
                f"job.loader() takes a torch.utils.data.DataLoader, got {type(loader).__name__}; "
                "for token files use checkpointless.data.BatchLoader, whose batch(step) is already exact"
            )
        if isinstance(loader.dataset, IterableDataset):
            raise ConfigError(
                f"job.loader() cannot seek in the iterable dataset {type(loader.dataset).__name__}: "
                "a replacement rank would have to read every sample before its position. Use a "
                "map-style Dataset (__getitem__ + __len__) with a DistributedSampler, or make the "
                "batch a pure function of the step (checkpointless.data.BatchLoader)"
            )
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:
            raise ConfigError(
                "job.loader() needs batches: the DataLoader was built with batch_size=None; give it "
                "a batch_size (or a batch_sampler)"
            )
        sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else loader.sampler
        if not _epoch_addressable(sampler) and not _epoch_addressable(batch_sampler):
            raise ConfigError(
                f"the DataLoader's sampler {type(sampler).__name__} has no set_epoch(), so its order "
                "is not a function of the epoch and a replacement could not find its position. Use "
                "DistributedSampler(dataset, num_replicas=job.world_size, rank=job.rank, "
                "shuffle=True, seed=...) instead of shuffle=True (it works with one rank too)"
            )
        _check_ranks(sampler, dp_rank, dp_size)
        if loader.num_workers > 0 and not getattr(loader, "in_order", True):
            raise ConfigError(
                "the DataLoader was built with in_order=False: its workers hand batches out in the "
                "order they finish, so step s's batch would change from one run (and one replay) to "
                "the next; leave in_order at its default (True)"
            )
        if not isinstance(batch_sampler, Sized) or len(batch_sampler) == 0:
            raise ConfigError(
                "job.loader() needs a DataLoader with a known, non-zero number of batches per epoch "
                f"(len(loader) failed or is 0 for {type(batch_sampler).__name__})"
            )
        self.batches_per_epoch = len(batch_sampler)
        self._source = loader
        self._sampler = sampler
        self._dp_rank = dp_rank
        self._slot_of = slot_of
        self._own = _Reader(loader, loader.batch_sampler, sampler)
        self._slots: dict[int, _Reader] = {}  # degraded mode: the readers of held slots

    @property
    def seeks(self) -> int:
        """Iterators this rank's reader started somewhere other than where the last one ended."""
        return self._own.seeks

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch inside the epoch) of ``step``."""
        if step < 0:
            raise ConfigError(f"step {step} is negative; steps count from 0")
        return divmod(step, self.batches_per_epoch)

    def batch(self, step: int) -> Any:
        """The batch of ``step`` for the slot whose pass is running (this rank's own, except in
        degraded mode's extra passes): held for a replay, next from the iterator, or after a seek."""
        epoch, pos = self.position(step)
        slot = self._slot_of() if self._slot_of is not None else None
        if slot is None or slot == self._dp_rank:
            return self._own.batch(step, epoch, pos)
        return self._reader_for(slot).batch(step, epoch, pos)

    def _reader_for(self, slot: int) -> _Reader:
        reader = self._slots.get(slot)
        if reader is not None:
            return reader
        own_batches = self._source.batch_sampler
        batch_sampler, sampler = _samplers_for_slot(own_batches, self._sampler, slot)
        if batch_sampler is own_batches and sampler is self._sampler:
            # nothing here depends on the rank: every rank reads the same batches (a
            # SequentialSampler), so the slot's batch is this rank's, read once
            reader = self._own
        else:
            length = len(batch_sampler)
            if length != self.batches_per_epoch:
                raise ConfigError(
                    f"slot {slot}'s share of the DataLoader has {length} batches per epoch and this "
                    f"rank's {self.batches_per_epoch}: degraded mode needs every rank's share to be "
                    "as long (DistributedSampler pads or drops to make it so)"
                )
            reader = _Reader(self._source, batch_sampler, sampler)
        self._slots[slot] = reader
        return reader

    def release_slots(self, keep: Iterable[int]) -> None:
        """Stop the readers of the slots not in ``keep`` (a spare took them back)."""
        for slot in set(self._slots) - set(keep):
            reader = self._slots.pop(slot)
            if reader is not self._own:
                reader.close()

    def close(self) -> None:
        """Stop the workers (also done when the job's loop ends)."""
        self._own.close()
        self.release_slots(())


class _Reader:
    """One share's batches by step: a twin of the user's DataLoader over an epoch view of
    ``batch_sampler``. A rank's own share has one; a degraded holder one more per held slot."""

    def __init__(self, loader: DataLoader[Any], batch_sampler: Any, sampler: Any) -> None:
        self._view = _EpochView(batch_sampler, sampler)
        self._generator = torch.Generator()
        workers = loader.num_workers
        self._twin: DataLoader[Any] = DataLoader(
            loader.dataset,
            batch_sampler=self._view,
            num_workers=workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context if workers else None,
            generator=self._generator,
            prefetch_factor=loader.prefetch_factor if workers else None,
            persistent_workers=loader.persistent_workers if workers else False,
            pin_memory_device=loader.pin_memory_device,
            in_order=loader.in_order,
        )
        self._iter: Iterator[Any] | None = None
        self._next = -1  # the step the live iterator yields next
        self._held: tuple[int, Any] | None = None  # the last batch handed out, for a replay
        self.seeks = 0  # iterators started somewhere other than where the last one ended

    def batch(self, step: int, epoch: int, pos: int) -> Any:
        """The batch of ``step`` (at ``pos`` in ``epoch``)."""
        if self._held is not None and self._held[0] == step:
            return self._held[1]  # a replay trains on the very batch it had
        if self._iter is None or step != self._next or pos == 0:
            if self._iter is not None and step != self._next:
                self.seeks += 1
            self._start(epoch, pos)
        assert self._iter is not None
        if self._twin.num_workers:  # the workers read it, on seeds of their own
            data = next(self._iter)
        else:
            with batch_rng(step):  # augmentation in this process: a function of the step
                data = next(self._iter)
        self._next = step + 1
        self._held = (step, data)
        return data

    def _start(self, epoch: int, pos: int) -> None:
        self._iter = None  # shuts down a non-persistent iterator's workers before new ones start
        self._view.epoch, self._view.start = epoch, pos
        # worker seeds: a function of the epoch, whoever makes the iterator and whenever
        self._generator.manual_seed((epoch * _EPOCH_SEED_MIX + 1) % (1 << 63))
        self._iter = iter(self._twin)

    def close(self) -> None:
        self._iter = None
        self._held = None
        self._next = -1
        # persistent workers live in the loader's cached iterator
        self._twin._iterator = None


def _samplers_for_slot(batch_sampler: Any, sampler: Any, slot: int) -> tuple[Any, Any]:
    """(batch sampler, sampler) of ``slot``'s share: copies of this rank's with ``rank`` set to
    the slot (a ``DistributedSampler``, or a batch sampler of one). A sampler without a ``rank``
    gives every rank the same order, so the slot's share is this rank's own."""
    slot_sampler = _with_rank(sampler, slot)
    if isinstance(batch_sampler, BatchSampler) and batch_sampler.sampler is sampler:
        if slot_sampler is sampler:
            return batch_sampler, sampler
        slot_batches = copy.copy(batch_sampler)
        slot_batches.sampler = slot_sampler
        return slot_batches, slot_sampler
    return _with_rank(batch_sampler, slot), slot_sampler


def _with_rank(obj: Any, slot: int) -> Any:
    if not isinstance(getattr(obj, "rank", None), int):
        return obj
    twin = copy.copy(obj)  # shallow: the dataset and the seed are shared, the rank is the slot's
    twin.rank = slot
    return twin


def _epoch_addressable(obj: object) -> bool:
    return callable(getattr(obj, "set_epoch", None)) or isinstance(obj, SequentialSampler)


def _check_ranks(sampler: object, dp_rank: int | None, dp_size: int | None) -> None:
    # a DistributedSampler built for another rank or world size silently trains on wrong shards
    for attr, want, fix in (
        ("num_replicas", dp_size, "num_replicas=job.world_size"),
        ("rank", dp_rank, "rank=job.rank"),
    ):
        have = getattr(sampler, attr, None)
        if want is not None and isinstance(have, int) and have != want:
            raise ConfigError(
                f"the DataLoader's {type(sampler).__name__} has {attr}={have}, but this job has "
                f"{want}; build it after checkpointless.init() with {fix}"
            )
