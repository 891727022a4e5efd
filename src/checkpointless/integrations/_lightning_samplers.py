"""A rank's own shuffle that its replacement can walk again: ``use_distributed_sampler=False``.

With ``Trainer(use_distributed_sampler=False)`` and ``DataLoader(shuffle=True)`` each rank keeps
the ``RandomSampler`` it was given, and that sampler, having no generator of its own, draws the
seed of each epoch's permutation from the global torch generator when the epoch's iterator
starts. On the rank that trains, that draw comes after the epoch before drew its dropout masks
(and whatever else the steps drew). A replacement catches up by walking Lightning's loop from
batch 0 without running ``training_step``: at every epoch's start its global generator stands
elsewhere, so it would draw another permutation and train on other samples than the rank it
replaces, silently.

So each such sampler gets a generator of its own as the fit starts (before the replacement's
generators are set to its predecessor's): one seed drawn from the global generator, the same
draw on the first start and on a replacement whose script seeds the rank alike. From then on the
epochs' permutations come from that generator alone, which the walk advances exactly as training
did. The first epoch's iterator has started by then (Lightning fetches its first batch before
``on_train_start``), from the global generator as it stood after the script's seeding, which a
replacement's process reproduces. A sampler given a generator by the script is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

__all__ = ["own_shuffle_generators"]


def _loaders(iterables: Any) -> Iterator[DataLoader[Any]]:
    if isinstance(iterables, DataLoader):
        yield iterables
    elif isinstance(iterables, dict):
        for v in iterables.values():
            yield from _loaders(v)
    elif isinstance(iterables, list | tuple):
        for v in iterables:
            yield from _loaders(v)


def own_shuffle_generators(train_dataloader: Any) -> int:
    """Give every generator-less ``RandomSampler`` of the training loaders a generator seeded
    from one draw of the global torch generator; returns how many it gave one."""
    given = 0
    for loader in _loaders(train_dataloader):
        samplers = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
        for sampler in {id(s): s for s in samplers if isinstance(s, RandomSampler)}.values():
            if sampler.generator is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                sampler.generator = torch.Generator().manual_seed(seed)
                given += 1
    return given
