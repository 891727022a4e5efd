"""Every rank's own loader positions kept with its generator records (recovery/rank_data.py): a
``shuffle=True`` StatefulDataLoader's position is per rank (its sampler's generator is seeded from
the per-rank global seed), the record carries it through its encoding and the keeper's, and a
rank that receives a peer's state loads its own positions over the peer's (own_rng.receiver_rng),
a survivor from its memory and a replacement from its predecessor's record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointless.recovery.job import Job
from checkpointless.recovery.own_rng import receiver_rng
from checkpointless.recovery.rank_data import LoaderPositions, decode_positions, encode_positions
from checkpointless.recovery.rank_rng import (
    RankRngKeeper,
    RngRecord,
    decode_record,
    encode_record,
    record_point,
)
from checkpointless.recovery.stateful_loader import StatefulStepLoader
from checkpointless.state.snapshot import capture_rng

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.timeout(60)


def _loader(rank: int) -> StatefulStepLoader:
    """A rank's loader as nanoGPT-style scripts build it: after seeding the global generator per
    rank, so its shuffle is the rank's own; 5 batches an epoch."""
    torch.manual_seed(1337 + rank)
    return StatefulStepLoader(torchdata.StatefulDataLoader(list(range(20)), batch_size=4, shuffle=True))


def _batches(loader: StatefulStepLoader, steps: range) -> list[list[int]]:
    return [loader.batch(s).tolist() for s in steps]


def test_positions_round_trip_with_their_tensors() -> None:
    tree = {"_loader0": {"positions": [{"step": 3, "epoch": 0, "loader": {"g": torch.arange(5), "n": 2}}]}}
    back = decode_positions(encode_positions(tree))
    assert back["_loader0"]["positions"][0]["step"] == 3
    assert torch.equal(back["_loader0"]["positions"][0]["loader"]["g"], torch.arange(5))
    with pytest.raises(ValueError):
        decode_positions(b"\x05\x00\x00\x00{oops")


def test_a_record_carries_the_positions_through_its_encoding() -> None:
    rng = capture_rng()
    plain = decode_record(encode_record(RngRecord(4, rng)))
    assert plain.data is None
    record = RngRecord(4, rng, None, b"positions")
    data = encode_record(record)
    assert record_point(data) == (4, None)
    assert decode_record(data).data == b"positions"
    torn = bytearray(data)
    torn[-20] ^= 1  # inside the positions: the digest refuses the record
    with pytest.raises(ValueError):
        decode_record(bytes(torn))


def test_a_receiver_loads_its_own_positions_over_the_senders() -> None:
    mine, peer = _loader(1), _loader(0)
    positions = LoaderPositions()
    positions.add("_loader0", mine)
    want = _batches(mine, range(0, 8))  # across an epoch boundary: the generator goes on
    assert want != _batches(peer, range(0, 8)), "the ranks' shuffles must differ"
    # both after step 4's batch: the record of where step 5 starts, as a step's first collective keeps it
    mine, peer = _loader(1), _loader(0)
    positions = LoaderPositions()
    positions.add("_loader0", mine)
    _batches(mine, range(0, 5))
    _batches(peer, range(0, 5))
    own = positions.capture()
    assert own is not None and positions.capture() is own  # nothing read since: the same bytes
    mine.load_state_dict(peer.state_dict())  # the replica's state arrives
    assert positions.restore(own, 5)
    assert _batches(mine, range(5, 8)) == want[5:]
    assert not positions.restore(own, 9), "a record without a position of the step is not loaded"


def test_the_keeper_writes_a_new_record_when_only_the_positions_moved(tmp_path: Path) -> None:
    loader = _loader(0)
    positions = LoaderPositions()
    positions.add("_loader0", loader)
    keeper = RankRngKeeper()
    keeper.configure(tmp_path, 0)
    keeper.positions = positions.capture
    rng = capture_rng()
    keeper.keep(2, rng)
    before = keeper.load(2)
    loader.batch(0)  # reads (its own generator): the global ones stand still
    keeper.keep(2, rng)
    after = keeper.load(2)
    assert before is not None and after is not None and before.data != after.data
    fresh = RankRngKeeper()
    fresh.configure(tmp_path, 0)
    on_disk = fresh.load(2)
    assert on_disk is not None and on_disk.data == after.data


def _job_with_loader(rank: int, tmp_path: Path) -> tuple[Any, StatefulStepLoader]:
    job = Job(None)
    m = job.internals
    m.rank = 1
    m.replicas.rank_rng.configure(tmp_path, 1)
    loader = _loader(rank)
    m.tracked.positions.add("_loader0", loader)
    m.replicas.rank_rng.positions = m.tracked.positions.capture
    return m, loader


def test_receiver_rng_restores_a_survivors_and_a_replacements_own_positions(tmp_path: Path) -> None:
    want = _batches(_loader(1), range(0, 8))
    # a survivor (rank 1) whose update of step 4 was cut short: its own record of step 5
    m, mine = _job_with_loader(1, tmp_path)
    _batches(mine, range(0, 5))
    m.replicas.rank_rng.keep(5, capture_rng())
    peer = _loader(0)
    _batches(peer, range(0, 5))
    mine.load_state_dict(peer.state_dict())
    receiver_rng(m, 5, capture_rng(), from_copy=False)
    assert _batches(mine, range(5, 8)) == want[5:]
    # its replacement in a fresh process: the record its predecessor left in shared memory
    m2, fresh = _job_with_loader(1, tmp_path)
    m2.is_replacement = True
    fresh.load_state_dict(peer.state_dict())
    receiver_rng(m2, 5, capture_rng(), from_copy=False)
    assert _batches(fresh, range(5, 8)) == want[5:]
