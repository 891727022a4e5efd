"""Each rank's generator records also kept on another host (recovery/rank_rng_peer.py): an
owner's records reach its keeper over its key server, the keeper holds the newest of each step
parity, a replacement on a third host fetches the one of the step it resumes at (and nothing for
a step the keeper does not hold), records written before the connection opens follow it, a keeper
on the owner's own host gets nothing; the record of where step s + 1 starts is kept as step s
issues its first collective and not written again unless something drew (rank_rng.py)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpointless.recovery.rank_rng import RankRngKeeper, RngRecord, encode_record, record_point, same_rng
from checkpointless.recovery.rank_rng_peer import PeerRecords, _Held, _split, pick
from checkpointless.rendezvous.server import KeyServer
from checkpointless.state.snapshot import capture_rng
from tests.unit.recovery.conftest import stream_route

pytestmark = pytest.mark.timeout(60)


def _wait(cond: object, what: str, timeout: float = 10.0) -> None:
    assert callable(cond)
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def _keeping(owner: PeerRecords, directory: Path) -> RankRngKeeper:
    rng = RankRngKeeper()
    rng.configure(directory, 0)
    rng.mirror = owner.send
    return rng


def test_records_reach_the_keeper_and_a_replacement_on_a_third_host_fetches_them(
    servers: list[KeyServer], tmp_path: Path
) -> None:
    a, b, c = servers
    owner, keeper = PeerRecords(), PeerRecords()
    owner.place(0, 1)
    keeper.place(1, 0)
    keeper.resume(0, stream_route(b, [a.address, b.address]))
    owner.resume(0, stream_route(a, [a.address, b.address]))
    rng = _keeping(owner, tmp_path)
    states = {}
    for step in (4, 5, 6):
        torch.rand(3)
        states[step] = capture_rng()
        rng.keep(step, states[step])
    _wait(lambda: {r.step for r in keeper.held(0)} == {5, 6}, "the keeper to hold steps 5 and 6")
    # host 0 is lost: rank 0's replacement runs on host 2 and asks rank 1
    replacement = PeerRecords()
    replacement.place(0, 1)
    route = stream_route(c, [c.address, b.address])
    got = replacement.fetch(route, 6, timeout=5.0)
    assert got is not None and got.step == 6 and same_rng(got.rng, states[6])
    assert replacement.fetch(route, 4, timeout=5.0) is None  # the keeper holds the newest two
    owner.close()


def test_records_written_before_the_connection_follow_it_newest_of_each_parity(
    servers: list[KeyServer], tmp_path: Path
) -> None:
    a, b, _ = servers
    owner, keeper = PeerRecords(), PeerRecords()
    owner.place(0, 1)
    keeper.place(1, 0)
    rng = _keeping(owner, tmp_path)
    for step in (1, 2, 3):
        torch.rand(2)
        rng.keep(step, capture_rng())
    keeper.resume(0, stream_route(b, [a.address, b.address]))
    owner.resume(0, stream_route(a, [a.address, b.address]))
    _wait(lambda: {r.step for r in keeper.held(0)} == {2, 3}, "steps 2 and 3 to follow the connection")
    assert owner.sent_frames == 2
    owner.close()


def test_a_keeper_on_the_owners_host_gets_nothing(servers: list[KeyServer], tmp_path: Path) -> None:
    a, _, _ = servers
    owner = PeerRecords()
    owner.place(0, 1)
    owner.resume(0, stream_route(a, [a.address, a.address]))  # one host: the shared memory serves
    _keeping(owner, tmp_path).keep(3, capture_rng())
    assert owner.sent_frames == 0
    assert owner.fetch(stream_route(a, [a.address, a.address]), 3, timeout=1.0) is None


def test_a_replacement_whose_keeper_is_gone_finds_no_record(servers: list[KeyServer]) -> None:
    a, _, _ = servers
    lonely = PeerRecords()
    lonely.place(0, 1)
    assert lonely.fetch(stream_route(a, [a.address, "127.0.0.9:9"]), 3, timeout=1.0) is None


def test_a_keeper_refuses_torn_records_and_answers_are_split_checked() -> None:
    whole = encode_record(RngRecord(5, capture_rng(), "eval"))
    assert record_point(whole) == (5, "eval")
    with pytest.raises(ValueError):
        record_point(whole[:-1])
    with pytest.raises(ValueError):
        record_point(whole[:40] + bytes([whole[40] ^ 1]) + whole[41:])
    other = encode_record(RngRecord(6, capture_rng()))
    records = _split(whole + other, [len(whole), len(other)])
    assert [r.step for r in records] == [5, 6] and pick(records, 6) is records[1]
    assert _split(whole + other, [len(whole)]) == []  # sizes that do not add up: nothing
    assert _split(whole, "x") == []
    assert [r.step for r in _split(whole[:-1] + b"!" + other, [len(whole), len(other)])] == [6]
    # what a keeper holds is checked as it is asked for: the body against the record's digest,
    # that digest against the one the owner sealed, the step against the sealed step
    assert _Held(5, whole[-16:], whole).verified() == whole
    assert _Held(5, whole[-16:], whole[:-17] + b"!" + whole[-16:]).verified() is None
    assert _Held(5, other[-16:], whole).verified() is None
    assert _Held(4, whole[-16:], whole).verified() is None


def test_the_next_steps_record_is_kept_at_the_first_collective_and_checked_at_the_update(
    tmp_path: Path,
) -> None:
    rng = RankRngKeeper()
    rng.configure(tmp_path, 0)
    sent: list[int] = []
    rng.mirror = lambda step, data: sent.append(record_point(data)[0])
    rng.at_entry(3, capture_rng())
    torch.rand(4)  # the forward's draws
    rng.at_collective(3)
    rng.at_collective(3)  # later buckets: nothing more
    rng.at_update(3)  # nothing drew since: no second write
    assert sent == [3, 4]
    at_collective = rng.load(4)
    random.random()  # a draw after the collective (Python's), seen by the update's check
    rng.at_update(3)
    assert sent == [3, 4, 4] and rng.load(4) is not at_collective
    np.random.rand()  # ... and NumPy's
    rng.at_update(3)
    assert sent == [3, 4, 4, 4]
    # a replay of step 3 begins again: its first collective keeps again
    rng.at_entry(3, capture_rng())
    torch.rand(1)
    rng.at_collective(3)
    assert sent[-1] == 4 and len(sent) == 6


def test_without_the_launcher_nothing_is_kept_at_a_collective() -> None:
    rng = RankRngKeeper()
    rng.at_collective(3)
    rng.at_update(3)
    assert rng.load(4) is None
