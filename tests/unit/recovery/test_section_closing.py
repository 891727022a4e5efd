"""How a section closed on a rank, carried in its generator record to its keeper one host over
(recovery/section_closing.py): the format and its cap, the record that carries it, the keeper's
report of its owners' passes, and a replacement on a third host taking it into its own files."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest
import torch

from checkpointless.recovery.held_lines import HeldLinesFile
from checkpointless.recovery.loop import LoopControl
from checkpointless.recovery.member import Member
from checkpointless.recovery.rank_rng import RankRngKeeper, RngRecord, decode_record, encode_record
from checkpointless.recovery.rank_rng_peer import PeerRecords
from checkpointless.recovery.rng_compare import same_rng
from checkpointless.recovery.section_closing import (
    HELD_CAP,
    WAIT_S,
    Closing,
    adopt,
    carry_end,
    carry_left,
    carry_pass,
    carry_shown,
    closing_of,
    decode_closing,
    encode_closing,
    own_left,
    owners_closings,
    owners_passed,
)
from checkpointless.recovery.section_pass import sections_report
from checkpointless.rendezvous.server import KeyServer
from checkpointless.state.snapshot import capture_rng
from tests.unit.recovery.conftest import stream_route

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Replicas:
    rank_rng: RankRngKeeper
    rank_rng_peer: PeerRecords


@dataclass
class _Member:
    """The parts of a Member these functions read."""

    rank: int
    world_size: int
    replicas: _Replicas
    is_replacement: bool = False
    loop: LoopControl = field(default_factory=LoopControl)


def _member(rank: int, world: int, directory: Path | None, peer: PeerRecords | None = None) -> Member:
    rng = RankRngKeeper()
    rng.configure(directory, rank)
    peer = peer if peer is not None else PeerRecords()
    rng.mirror = peer.send
    return cast(Member, _Member(rank, world, _Replicas(rng, peer)))


def _wait_for(peer: PeerRecords, owner: int, passed: bool, held: bool = True) -> None:
    """Until the keeper holds ``owner``'s closing with ``passed``, and held lines or not."""
    end = time.monotonic() + 10.0
    while True:
        got = [decode_closing(r.closing) for r in peer.held(owner) if r.closing is not None]
        if got and got[0].passed == passed and (got[0].held is not None) == held:
            return
        assert time.monotonic() < end, f"the keeper never held rank {owner}'s closing (passed={passed})"
        time.sleep(0.01)


def test_a_closing_round_trips_and_a_malformed_one_is_refused() -> None:
    end = capture_rng()
    closing = closing_of(10, "eval", end, b'[{"eval_loss": 1.5}]')
    back = decode_closing(encode_closing(closing))
    assert back == closing and not back.passed and back.held_size == 20
    assert back.end is not None and same_rng(decode_record(back.end).rng, end)
    bare = Closing(3, "save", passed=True)
    assert decode_closing(encode_closing(Closing(3, "save", left=True))).left
    assert decode_closing(encode_closing(bare)) == bare
    whole = encode_closing(closing)
    for bad in (whole[:-1], b"", b"x" * 40, whole.replace(b'"step": 10', b'"step": "x"')):
        with pytest.raises(ValueError, match=r"not a section's closing|malformed"):
            decode_closing(bad)


def test_held_lines_over_the_cap_travel_by_their_size_only() -> None:
    at_cap = closing_of(4, "eval", capture_rng(), b"x" * HELD_CAP)
    assert at_cap.held is not None and not at_cap.held_left_behind
    over = closing_of(4, "eval", capture_rng(), b"x" * (HELD_CAP + 1))
    assert over.held is None and over.held_size == HELD_CAP + 1 and over.held_left_behind
    assert len(encode_closing(over)) < 16 << 10  # the record stays small
    none = closing_of(4, "eval", capture_rng(), None)
    assert none.held is None and not none.held_left_behind


def test_the_record_carries_it_and_the_next_write_of_the_step_drops_it(tmp_path: Path) -> None:
    rng = capture_rng()
    record = RngRecord(7, rng, "eval", b"positions", b"closing")
    back = decode_record(encode_record(record))
    assert (back.step, back.section, back.data, back.closing) == (7, "eval", b"positions", b"closing")
    assert decode_record(encode_record(RngRecord(7, rng))).closing is None
    keeper = RankRngKeeper()
    keeper.configure(tmp_path, 0)
    assert not keeper.attach(7, b"c")  # no record of step 7 yet
    keeper.keep(7, rng, "eval")
    assert keeper.attach(7, b"c")
    successor = RankRngKeeper()
    successor.configure(tmp_path, 0)
    loaded = successor.load(7)
    assert loaded is not None and loaded.closing == b"c" and loaded.section == "eval"
    keeper.keep(7, rng, "eval")  # the same point again (a redone section): not carried on
    assert (keeper.load(7) or record).closing is None


def test_a_keeper_reports_its_owners_passes_and_a_third_host_adopts_the_lines(
    servers: list[KeyServer], tmp_path: Path
) -> None:
    a, b, c = servers
    host_a, host_b, host_c = (tmp_path / h for h in "abc")
    for d in (host_a, host_b, host_c):
        d.mkdir()
    owner_peer, keeper_peer = PeerRecords(), PeerRecords()
    owner_peer.place(1, 0)
    keeper_peer.place(0, 1)
    keeper_peer.resume(0, stream_route(a, [a.address, b.address]))
    owner_peer.resume(0, stream_route(b, [a.address, b.address]))
    owner = _member(1, 2, host_b, owner_peer)
    keeper = _member(0, 2, host_a, keeper_peer)
    start = capture_rng()
    owner.replicas.rank_rng.keep(10, start, "eval")  # the section begins
    torch.rand(5)  # ... and draws
    end = capture_rng()
    carry_end(owner, 10, "eval", end, b"lines")  # before the closing barrier
    _wait_for(keeper_peer, 1, passed=False)
    began = time.monotonic()  # entered the barrier, not passed: the keeper waits, then says so
    assert owners_passed(keeper, 10) == [] and time.monotonic() - began >= WAIT_S
    # ... and still undecided when the wait runs out: reported so, for the redo to be said
    assert owners_closings(keeper, 10, wait_s=0.0) == ([], {"eval": [1]})
    assert sections_report(keeper, 10) == {"sections_closed": [], "sections_entered": {"eval": [1]}}
    assert owners_passed(keeper, 10, known=["eval"]) == []  # passed here itself: no wait
    carry_pass(owner, 10, "eval")  # just after it
    _wait_for(keeper_peer, 1, passed=True)
    assert owners_passed(keeper, 10) == ["eval"] and owners_passed(keeper, 9) == []
    assert sections_report(keeper, 10) == {"sections_closed": ["eval"]}  # beside its own (none)
    # host b is lost: rank 1's replacement runs on host c and asks rank 0 for the record of step 10
    replacement_peer = PeerRecords()
    replacement_peer.place(1, 0)
    fetched = replacement_peer.fetch(stream_route(c, [a.address, c.address]), 10, timeout=5.0)
    assert fetched is not None and same_rng(fetched.rng, start)  # a redone section starts there
    replacement = _member(1, 2, host_c, replacement_peer)
    assert adopt(replacement, fetched) is None
    assert HeldLinesFile(host_c, 1).load(10, "eval") == b"lines"
    kept_end = replacement.replicas.rank_rng.load_section_end(10, "eval")
    assert kept_end is not None and same_rng(kept_end.rng, end)
    # shown by ``closed``: a replacement must not show them again, the pass still counts
    carry_shown(owner, 10, "eval")
    _wait_for(keeper_peer, 1, passed=True, held=False)
    assert owners_passed(keeper, 10) == ["eval"]
    owner_peer.close()


def test_a_replacement_is_told_of_lines_left_behind_over_the_cap(tmp_path: Path) -> None:
    over = closing_of(6, "eval", capture_rng(), b"y" * (HELD_CAP + 1))
    record = RngRecord(6, capture_rng(), "eval", None, encode_closing(over))
    replacement = _member(2, 3, tmp_path)
    why = adopt(replacement, record)
    assert why is not None and str(HELD_CAP + 1) in why and str(HELD_CAP) in why
    assert HeldLinesFile(tmp_path, 2).load(6, "eval") is None  # never a cut line
    assert adopt(replacement, RngRecord(6, capture_rng())) is None  # nothing carried


def test_an_owner_whose_barrier_failed_ends_its_keepers_wait(
    servers: list[KeyServer], tmp_path: Path
) -> None:
    a, b, _ = servers
    owner_peer, keeper_peer = PeerRecords(), PeerRecords()
    owner_peer.place(1, 0)
    keeper_peer.place(0, 1)
    keeper_peer.resume(0, stream_route(a, [a.address, b.address]))
    owner_peer.resume(0, stream_route(b, [a.address, b.address]))
    owner = _member(1, 2, tmp_path / "b", owner_peer)
    (tmp_path / "b").mkdir()
    keeper = _member(0, 2, tmp_path / "a", keeper_peer)
    owner.replicas.rank_rng.keep(10, capture_rng(), "eval")
    carry_end(owner, 10, "eval", capture_rng(), None)
    assert own_left(owner, 10) == []  # entered, not yet failed
    carry_left(owner, 10, "eval")  # its closing barrier failed: it did not pass
    assert own_left(owner, 10) == ["eval"] and own_left(owner, 9) == []  # as it reports it
    end = time.monotonic() + 10.0
    while not any(decode_closing(r.closing).left for r in keeper_peer.held(1) if r.closing is not None):
        assert time.monotonic() < end, "the keeper never held the owner's closing"
        time.sleep(0.01)
    began = time.monotonic()
    assert owners_passed(keeper, 10, wait_s=30.0) == [] and time.monotonic() - began < 5.0
    owner_peer.close()
