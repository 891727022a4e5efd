"""A rank's own global generators, kept for its replacement (recovery/rank_rng.py): the record
restores every stream exactly, a torn or foreign record is never restored, the newest two steps
are kept, a fresh replacement finds its predecessor's record, a rank that receives its replica's
state keeps its own generators (own_rng.receiver_rng), and job.generator works in a section."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.recovery.job import Job
from checkpointless.recovery.own_rng import receiver_rng
from checkpointless.recovery.rank_rng import RankRngKeeper, RngRecord, decode_record, encode_record
from checkpointless.state.snapshot import RngState, capture_rng, restore_rng


def _draws() -> tuple[torch.Tensor, float, float, np.ndarray]:
    """A few draws from every global generator (gauss: Python's and NumPy's cached second value)."""
    return torch.rand(5), random.gauss(0, 1), random.random(), np.random.standard_normal(3)


def _same(
    a: tuple[torch.Tensor, float, float, np.ndarray], b: tuple[torch.Tensor, float, float, np.ndarray]
) -> bool:
    return torch.equal(a[0], b[0]) and a[1:3] == b[1:3] and np.array_equal(a[3], b[3])


def _seed(n: int) -> None:
    torch.manual_seed(n)
    random.seed(n)
    np.random.seed(n)


@pytest.mark.timeout(60)
def test_a_record_restores_every_global_stream_exactly() -> None:
    _seed(1337)
    _draws()  # mid-stream, with a cached gauss on both Python's and NumPy's side
    random.gauss(0, 1)
    np.random.standard_normal(1)
    record = encode_record(RngRecord(7, capture_rng(), "eval"))
    want = _draws()
    _seed(99)
    got = decode_record(record)
    assert got.step == 7 and got.section == "eval"
    restore_rng(got.rng)
    assert _same(_draws(), want)


@pytest.mark.timeout(60)
def test_a_torn_or_foreign_record_is_refused() -> None:
    record = encode_record(RngRecord(3, capture_rng()))
    for bad in (
        record[:-1],
        record[:40],
        b"x" + record[1:],
        record[:-17] + bytes([record[-17] ^ 1]) + record[-16:],
    ):
        with pytest.raises(ValueError):
            decode_record(bad)


@pytest.mark.timeout(60)
def test_the_keeper_keeps_the_newest_two_steps_for_a_fresh_process(tmp_path: Path) -> None:
    mine = RankRngKeeper()
    mine.configure(tmp_path, 1)
    assert not mine.began and mine.load(0) is None
    states: dict[int, RngState] = {}
    for step in (4, 5, 6):
        _seed(step)
        states[step] = capture_rng()
        mine.keep(step, states[step])
    assert mine.began
    # what a replacement of rank 1 (another process: nothing in memory) reads
    fresh = RankRngKeeper()
    fresh.configure(tmp_path, 1)
    assert not fresh.began
    assert fresh.load(4) is None  # overwritten by step 6 (same parity)
    for step in (5, 6):
        kept = fresh.load(step)
        assert kept is not None and kept.section is None
        restore_rng(kept.rng)
        a = _draws()
        restore_rng(states[step])
        assert _same(a, _draws())
    other = RankRngKeeper()
    other.configure(tmp_path, 0)
    assert other.load(6) is None  # rank 0's replacement never takes rank 1's streams
    # a record over a longer older one: its tail is ignored; a write cut short is refused
    path = tmp_path / "rank1.0"
    path.write_bytes(path.read_bytes() + b"an older record's tail")
    assert fresh.load(6) is not None
    path.write_bytes(path.read_bytes()[:5000])
    assert fresh.load(6) is None and mine.load(6) is not None  # the writer's memory still has it


@pytest.mark.timeout(60)
def test_a_receiver_resumes_its_own_generators_never_the_senders(tmp_path: Path) -> None:
    sent = capture_rng()
    _seed(5)
    own = capture_rng()
    job = Job(None)
    m = job.internals
    m.rank = 1
    m.replicas.rank_rng.configure(tmp_path, 1)
    # a rank that ran the step here: its generators as the step began
    m.record.rng_at_start = (9, own)
    assert receiver_rng(m, 9, sent, from_copy=False) is own
    # a fresh replacement: its predecessor's record of the step, else (with a warning) the sender's
    m.record.rng_at_start = None
    m.is_replacement = True
    assert receiver_rng(m, 9, sent, from_copy=False) is sent
    writer = RankRngKeeper()
    writer.configure(tmp_path, 1)
    writer.keep(9, own)
    got = receiver_rng(m, 9, sent, from_copy=False)
    restore_rng(got)
    a = _draws()
    restore_rng(own)
    assert _same(a, _draws())


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.timeout(60)
def test_a_replacement_lost_inside_a_section_its_peers_completed_says_so(tmp_path: Path) -> None:
    """Rank 0 killed inside its evaluation (no collective: rank 1 finished the section): the
    received loop state says it is done, so the replacement will not draw its batches again."""
    _seed(3)
    at_eval = capture_rng()
    writer = RankRngKeeper()
    writer.configure(tmp_path, 0)
    writer.keep(16, at_eval, "eval")
    m = Job(None).internals
    m.is_replacement = True
    m.replicas.rank_rng.configure(tmp_path, 0)
    lines = _Lines()
    get_logger().addHandler(lines)
    try:
        assert receiver_rng(m, 16, capture_rng(), from_copy=False)["torch"].equal(at_eval["torch"])
        assert not lines.lines  # the section is not done: the replacement runs it with the others
        m.loop.sections_done["eval"] = 16
        receiver_rng(m, 16, capture_rng(), from_copy=False)
        assert any("inside section 'eval'" in line for line in lines.lines), lines.lines
    finally:
        get_logger().removeHandler(lines)


@pytest.mark.timeout(60)
def test_a_replacement_lost_as_its_peers_passed_the_sections_barrier_resumes_where_it_left(
    tmp_path: Path,
) -> None:
    """Rank 0 killed as it passes the closing barrier of an evaluation that drew (its peer is
    past it, so the section is done): its replacement resumes the generators as the section left
    them, kept before that barrier, and nothing is reported; a redone section (not done) still
    starts from where the section began."""
    _seed(4)
    at_eval = capture_rng()
    torch.rand(3)  # the evaluation draws
    after_eval = capture_rng()
    writer = RankRngKeeper()
    writer.configure(tmp_path, 0)
    writer.keep(16, at_eval, "eval")
    writer.keep_section_end(16, after_eval, "eval")
    m = Job(None).internals
    m.is_replacement = True
    m.replicas.rank_rng.configure(tmp_path, 0)
    assert m.replicas.rank_rng.load_section_end(16, "other") is None  # another section's end
    assert m.replicas.rank_rng.load_section_end(12, "eval") is None  # another boundary's
    lines = _Lines()
    get_logger().addHandler(lines)
    try:
        assert receiver_rng(m, 16, capture_rng(), from_copy=False)["torch"].equal(at_eval["torch"])
        m.loop.sections_done["eval"] = 16
        got = receiver_rng(m, 16, capture_rng(), from_copy=False)
        assert not lines.lines, lines.lines
    finally:
        get_logger().removeHandler(lines)
    restore_rng(got)
    a = _draws()
    restore_rng(after_eval)
    assert _same(a, _draws())


@pytest.mark.timeout(60)
def test_job_generator_works_in_a_section_and_restarts_with_it() -> None:
    job = Job(None)
    m = job.internals
    m.rank, m.committed_step = 1, 8
    with pytest.raises(ConfigError, match="outside a step or a section"):
        job.generator("eval")
    m.clock.in_section = "eval"
    m.record.begin_section(8)
    first = torch.rand(3, generator=job.generator("eval", seed=3))
    more = torch.rand(3, generator=job.generator("eval", seed=3))  # the stream continues
    assert not torch.equal(first, more)
    m.record.begin_section(8)  # the section redone after a fault: from the start of its stream
    assert torch.equal(torch.rand(3, generator=job.generator("eval", seed=3)), first)
    m.rank = 0
    m.record.begin_section(8)
    assert not torch.equal(torch.rand(3, generator=job.generator("eval", seed=3)), first)  # per rank
    # the same name in the step that follows is a stream of its own
    m.clock.in_section = None
    m.clock.step_index = 8
    m.record.begin(8)
    m.rank = 1
    assert not torch.equal(torch.rand(3, generator=job.generator("eval", seed=3)), first)


@pytest.mark.timeout(60)
def test_the_update_keeps_the_next_steps_start_and_the_commit_checks_it(tmp_path: Path) -> None:
    keeper = RankRngKeeper()
    keeper.at_update(3)  # not under the launcher: nothing kept (no recovery to resume from)
    assert not keeper.began
    keeper.configure(tmp_path, 0)
    _seed(8)
    keeper.at_update(3)  # the step's draws are done: this is where step 4 starts
    at_update = capture_rng()
    fresh = RankRngKeeper()
    fresh.configure(tmp_path, 0)
    kept = fresh.load(4)
    assert kept is not None and kept.rng["torch"].equal(at_update["torch"])
    keeper.at_commit(3)  # nothing drew since: the record stands
    torch.rand(2)  # a draw after the update (logging, say): the commit keeps the new stand
    keeper.at_commit(3)
    kept = fresh.load(4)
    assert kept is not None and kept.rng["torch"].equal(torch.get_rng_state())
    keeper.at_commit(4)  # no update ran in step 4 (a skipped GradScaler step): kept at the commit
    assert fresh.load(5) is not None
