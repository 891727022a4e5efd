"""The training DataLoader of ``CheckpointlessAccelerator``, made step-addressable, and one
attempt at an optimizer step over its micro-batches.

integrations/hf_accelerate.py hands the loop a :class:`StepDataLoader` for the first DataLoader
it prepares: the same dataset, batch size and collator, sampled by a ``DistributedSampler`` over
the job's ranks, so that a batch is a function of (epoch, position) and ``job.loader`` can seek
a replacement to its step. Iterating it runs the accelerator's generator of one epoch's
micro-batches; :class:`Attempt` is where that generator and accelerate's ``accumulate`` blocks
meet: how many of the step's blocks have run, and whether one failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from checkpointless.errors import ConfigError
from checkpointless.integrations._hf_state import StepPlan
from checkpointless.recovery.job import Job, Step

__all__ = ["Attempt", "StepDataLoader"]


@dataclass
class Attempt:
    """One attempt at a step: how many of its micro-batches' blocks have run, and how it ended."""

    step: Step
    count: int
    entered: bool = False
    done: int = 0
    failed: bool = False


class StepDataLoader:
    """The training DataLoader, step-addressable: iterate it once per epoch, as the original.
    ``batches(loader, epoch)`` is the accelerator's generator of one epoch's micro-batches."""

    def __init__(
        self,
        dl: DataLoader[Any],
        job: Job,
        accumulation: int,
        seed: int,
        batches: Callable[[StepDataLoader, int], Iterator[Any]],
    ) -> None:
        if isinstance(dl.dataset, IterableDataset) or dl.batch_size is None:
            raise ConfigError(
                "CheckpointlessAccelerator needs a map-style dataset and a batch_size for the training "
                "DataLoader: its batches must be a function of (epoch, position)"
            )
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
        self.plan = StepPlan(len(self.twin), accumulation)
        self._batches = batches
        self.epochs_started = 0
        # the step boundary the loop is at: the committed steps, or, in an epoch a replacement
        # passes because its state holds it already, that epoch's end
        self.loop_at = 0

    def __len__(self) -> int:
        return len(self.twin)

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epochs_started
        self.epochs_started += 1
        return self._batches(self, epoch)
