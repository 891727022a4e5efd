"""Degraded mode's reads of a held slot's data (issue 39), in one process: a ``job.loader()``
asked for a held slot's batch returns exactly what that slot's own rank would have read (its
DistributedSampler share, across epochs, with and without workers, read interleaved with this
rank's own as a holder's passes do), a loader whose order does not depend on the rank gives the
same batch, a StatefulDataLoader refuses, and ``job.generator``'s stream in a held slot's pass is
the slot's rank's, not a continuation of the holder's."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler

from checkpointless.errors import ConfigError
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.rng import StepStreams
from checkpointless.recovery.stateful_loader import StatefulStepLoader

pytestmark = pytest.mark.timeout(60)

WORLD = 3


class Numbers(Dataset[int]):
    """Sample i is i."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        return i


class Slot:
    """The held slot whose pass runs (None: this rank's own), as the job's clock says."""

    def __init__(self) -> None:
        self.held: int | None = None

    def __call__(self) -> int | None:
        return self.held


def dataloader(rank: int, workers: int = 0) -> DataLoader[int]:
    sampler = DistributedSampler(Numbers(), num_replicas=WORLD, rank=rank, shuffle=True, seed=5)
    return DataLoader(Numbers(), batch_size=3, sampler=sampler, drop_last=True, num_workers=workers)


def alone(rank: int, steps: range) -> list[list[int]]:
    """What rank ``rank``'s own loader reads at full width."""
    loader = StepLoader(dataloader(rank), dp_rank=rank, dp_size=WORLD)
    try:
        return [loader.batch(s).tolist() for s in steps]
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_held_slot_reads_its_rank_s_share_interleaved_with_its_own(workers: int) -> None:
    steps = range(3, 12)  # the holder takes slot 2 over mid-epoch; an epoch is 4 batches here
    want_own, want_held = alone(0, steps), alone(2, steps)
    slot = Slot()
    loader = StepLoader(dataloader(0, workers), dp_rank=0, dp_size=WORLD, slot_of=slot)
    own: list[list[int]] = []
    held: list[list[int]] = []
    try:
        for s in steps:
            slot.held = None
            own.append(loader.batch(s).tolist())
            slot.held = 2
            held.append(loader.batch(s).tolist())
            assert loader.batch(s).tolist() == held[-1]  # a replay of the held pass
        assert (own, held) == (want_own, want_held)
        assert loader.seeks == 0  # the held slot's reads never moved this rank's own iterator
        loader.release_slots([0])  # a spare took slot 2 back
        slot.held = None
        assert loader.batch(steps[-1] + 1).tolist() == alone(0, range(steps[-1] + 1, steps[-1] + 2))[0]
    finally:
        loader.close()


def test_a_loader_whose_order_does_not_depend_on_the_rank_gives_the_same_batch() -> None:
    slot = Slot()
    loader = StepLoader(
        DataLoader(Numbers(), batch_size=4, sampler=SequentialSampler(Numbers())), slot_of=slot
    )
    mine = loader.batch(2)
    slot.held = 1
    assert loader.batch(2) is mine  # read once: every rank reads these very samples
    loader.close()


def test_a_stateful_dataloader_refuses_a_held_slot_s_pass() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    slot = Slot()
    sdl = stateful.StatefulDataLoader(Numbers(), batch_size=4)
    loader = StatefulStepLoader(sdl, next_step=lambda: 0, slot_of=slot)
    assert loader.batch(0).tolist() == [0, 1, 2, 3]
    slot.held = 1
    with pytest.raises(ConfigError, match="cannot read held slot 1's batch in degraded mode"):
        loader.batch(0)
    loader.close()


def test_a_held_slot_s_generator_is_its_rank_s_stream_not_the_holder_s() -> None:
    def draw(streams: StepStreams, rank: int) -> list[float]:
        g = streams.get("dropout", seed=3, rank=rank, step=7, device="cpu")
        return torch.rand(4, generator=g).tolist()

    full_width = [draw(StepStreams(), rank) for rank in (0, 2)]
    holder = StepStreams()
    assert [draw(holder, 0), draw(holder, 2)] == full_width
