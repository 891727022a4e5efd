"""The training DataLoader of ``CheckpointlessTrainer``: batches that are a function of
(epoch, position), so that integrations/hf.py can make it step-addressable with ``job.loader``.

Trainer's own DataLoader shards a ``RandomSampler`` through accelerate; this one samples with a
``DistributedSampler`` over the job's ranks instead (seeded with ``data_seed``, else ``seed``),
and keeps Trainer's collator and the rest of its DataLoader settings.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from checkpointless.errors import ConfigError
from checkpointless.integrations._hf_internals import train_collator

__all__ = ["train_dataloader"]


def train_dataloader(trainer: Any, rank: int, world_size: int) -> DataLoader[Any]:
    """``trainer.train_dataset`` (map-style) as this rank's shard, in Trainer's batches."""
    if trainer.train_dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    if isinstance(trainer.train_dataset, IterableDataset) or not hasattr(trainer.train_dataset, "__len__"):
        raise ConfigError(
            "CheckpointlessTrainer needs a map-style train_dataset (__getitem__ + __len__): an "
            "iterable dataset cannot be sought to a replacement's step"
        )
    args = trainer.args
    dataset, collate = train_collator(trainer, trainer.train_dataset)
    seed = args.data_seed if args.data_seed is not None else args.seed
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    workers = args.dataloader_num_workers
    return DataLoader(
        dataset,
        batch_size=args.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        pin_memory=args.dataloader_pin_memory,
        drop_last=args.dataloader_drop_last,
        persistent_workers=args.dataloader_persistent_workers if workers else False,
        prefetch_factor=args.dataloader_prefetch_factor if workers else None,
    )
