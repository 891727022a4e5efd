"""integrations/_lightning_samplers.py: a rank's own shuffle that its replacement walks again."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from checkpointless.integrations._lightning_samplers import own_shuffle_generators

pytestmark = pytest.mark.timeout(60)


def _epochs(loader: DataLoader[int], n: int) -> list[list[int]]:
    return [[int(b) for batch in loader for b in batch] for _ in range(n)]


def test_later_epochs_do_not_depend_on_what_the_steps_drew() -> None:
    data = list(range(10))
    orders = []
    for draws in (0, 5):  # the training rank draws (dropout), its replacement's walk does not
        torch.manual_seed(7)
        loader = DataLoader(data, batch_size=2, shuffle=True)
        assert own_shuffle_generators({"train": [loader]}) == 1
        first = [int(b) for batch in loader for b in batch]
        torch.rand(draws)
        orders.append([first, *_epochs(loader, 2)])
    assert orders[0] == orders[1]
    assert orders[0][1] != orders[0][2], "each epoch its own permutation"


def test_a_sampler_with_a_generator_or_no_shuffle_is_left_alone() -> None:
    g = torch.Generator().manual_seed(1)
    given = DataLoader(list(range(4)), sampler=RandomSampler(list(range(4)), generator=g))
    plain = DataLoader(list(range(4)))
    assert own_shuffle_generators((given, plain, None)) == 0
    assert given.sampler.generator is g  # type: ignore[attr-defined]
    assert isinstance(plain.sampler, SequentialSampler)
