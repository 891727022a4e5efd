"""Coordinator failover, the pure rules: who is elected (coordinator/rules/election.py) and the state a
new coordinator rebuilds from reports (coordinator/rules/rebuild.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.agent.join import Refused, job_outcome
from checkpointless.coordinator import Coordinator, Emit, Kill, Send, Stop
from checkpointless.coordinator.rules.election import (
    Ballot,
    HostSeen,
    candidate_for,
    elect_on_side,
    first_live_term,
    has_quorum,
    keeps_majority,
    membership,
    quorum,
)
from checkpointless.coordinator.rules.rebuild import Finished, ProcReport, WorkerReport, rebuild
from checkpointless.coordinator.takeover import TakeoverHost, resume
from checkpointless.launcher.launcher import config_from_json, config_to_json
from checkpointless.launcher.model import LaunchConfig
from checkpointless.launcher.runfiles import (
    COORDINATOR_FILE,
    forget_coordinator,
    record_coordinator,
    recorded_coordinator,
)
from checkpointless.protocol import Abort, Assign, DoneSeen, Stopped
from tests.helpers.coordinator import new_coordinator

pytestmark = pytest.mark.timeout(60)


def test_quorum_is_a_strict_majority() -> None:
    assert [quorum(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="at least one host"):
        quorum(0)


def test_votes_from_outside_the_membership_do_not_count() -> None:
    assert has_quorum({0, 1}, {0, 1, 2})
    assert not has_quorum({0, 7, 8}, {0, 1, 2})  # 7 and 8 joined after the last succession


def test_each_term_has_one_candidate_in_successor_order() -> None:
    assert [candidate_for(t, [4, 2, 9]) for t in range(1, 7)] == [4, 2, 9, 4, 2, 9]
    with pytest.raises(ValueError, match="term 0"):
        candidate_for(0, [1])
    with pytest.raises(ValueError, match="empty successor list"):
        candidate_for(1, [])


def test_a_dead_candidate_is_skipped_to_the_next_term() -> None:
    assert first_live_term(0, [0, 1, 2], {1, 2}) == 2
    assert first_live_term(3, [0, 1, 2], {0, 2}) == 4  # wraps around the list
    assert first_live_term(0, [0, 1, 2], set()) is None


def test_a_ballot_votes_once_per_term_and_never_goes_back() -> None:
    b = Ballot()
    assert b.cast(1)
    assert not b.cast(1)  # a second vote in the same term
    assert b.cast(3)
    assert not b.cast(2)  # a stale term


def test_coordinator_lost_with_every_agent_alive_elects_the_first_successor() -> None:
    assert elect_on_side({0, 1, 2}, {0, 1, 2}, [0, 1, 2], 0) == (1, 0)


def test_two_hosts_have_no_majority_after_losing_one() -> None:
    # the documented limit: a two-host job fences rather than risk two coordinators
    assert elect_on_side({1}, {0, 1}, [0, 1], 0) is None
    assert elect_on_side({0}, {0, 1}, [0, 1], 0) is None


@st.composite
def _partitions(draw: st.DrawFn) -> tuple[list[int], list[int], set[int], set[int]]:
    n = draw(st.integers(1, 9))
    members = list(range(n))
    successors = draw(st.permutations(members))
    side = draw(st.sets(st.sampled_from(members)))
    return members, list(successors), side, set(members) - side


@settings(max_examples=300, deadline=None)
@given(_partitions(), st.integers(0, 20))
def test_disjoint_sides_never_both_elect(
    p: tuple[list[int], list[int], set[int], set[int]], last: int
) -> None:
    members, successors, a, b = p
    assert (
        elect_on_side(a, members, successors, last) is None
        or elect_on_side(b, members, successors, last) is None
    )


@settings(max_examples=300, deadline=None)
@given(_partitions(), st.integers(0, 20))
def test_a_majority_side_elects_exactly_one_of_its_own(
    p: tuple[list[int], list[int], set[int], set[int]], last: int
) -> None:
    members, successors, side, _ = p
    won = elect_on_side(side, members, successors, last)
    if len(side) >= quorum(len(members)):
        assert won is not None
        term, who = won
        assert who in side and term > last and candidate_for(term, successors) == who
    else:
        assert won is None


# -- rebuild ------------------------------------------------------------------------------------
def _procs(*spec: tuple[int, int, str]) -> list[ProcReport]:
    return [ProcReport(wid, host, role, 1000 + wid) for wid, host, role in spec]


def test_rebuild_keeps_every_reconnected_rank_and_the_spares() -> None:
    procs = _procs((0, 0, "worker"), (1, 0, "worker"), (2, 1, "worker"), (3, 1, "worker"), (4, 2, "spare"))
    workers = [WorkerReport(i, i, 3, 17) for i in range(4)] + [WorkerReport(4, None, -1, -1, ready=True)]
    r = rebuild(procs, workers, nproc=4)
    assert r.ranks == {0: 0, 1: 1, 2: 2, 3: 3}
    assert r.missing == [] and r.kill == []
    assert r.spares == [4] and r.ready == [4]
    assert r.generation == 4 and r.formed
    assert r.next_worker_id == 5


def test_rebuild_marks_silent_ranks_missing_and_kills_their_processes() -> None:
    procs = _procs((0, 0, "worker"), (1, 0, "worker"), (2, 1, "worker"), (5, 2, "spare"))
    workers = [WorkerReport(0, 0, 1, 9), WorkerReport(1, 1, 1, 9), WorkerReport(5, None, -1, -1)]
    r = rebuild(procs, workers, nproc=3)
    assert r.missing == [2]  # worker 2 never reconnected: nobody can vouch for its state
    assert r.kill == [2]
    assert r.spares == [5] and r.ready == []


def test_rebuild_gives_a_doubly_claimed_rank_to_the_newer_generation() -> None:
    # the old holder of rank 1 (generation 2) and the spare that took it (generation 3)
    procs = _procs((0, 0, "worker"), (1, 0, "worker"), (7, 2, "spare"))
    workers = [WorkerReport(0, 0, 3, 20), WorkerReport(1, 1, 2, 12), WorkerReport(7, 1, 3, 20)]
    r = rebuild(procs, workers, nproc=2)
    assert r.ranks == {0: 0, 1: 7}
    assert r.kill == [1]


def test_rebuild_ignores_workers_no_voting_agent_reported() -> None:
    procs = _procs((0, 0, "worker"))
    workers = [WorkerReport(0, 0, 0, 5), WorkerReport(1, 1, 0, 5)]  # worker 1's host did not vote
    r = rebuild(procs, workers, nproc=2)
    assert r.ranks == {0: 0} and r.missing == [1] and r.kill == []


def test_rebuild_before_any_generation_formed_has_no_state() -> None:
    r = rebuild(_procs((0, 0, "worker")), [WorkerReport(0, 0, -1, -1)], nproc=1)
    assert not r.formed and r.generation == 0
    with pytest.raises(ValueError, match="nproc=0"):
        rebuild([], [], nproc=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.one_of(st.none(), st.integers(-1, 5)), st.integers(-1, 6)),
        unique_by=lambda t: t[0],
        max_size=12,
    )
)
def test_rebuild_never_gives_a_rank_to_two_processes(claims: list[tuple[int, int | None, int]]) -> None:
    procs = [ProcReport(wid, 0, "spare" if rank is None else "worker", 1) for wid, rank, _ in claims]
    workers = [WorkerReport(wid, rank, gen, gen * 10) for wid, rank, gen in claims]
    r = rebuild(procs, workers, nproc=4)
    holders = list(r.ranks.values())
    assert len(holders) == len(set(holders))
    assert set(r.ranks) | set(r.missing) == set(range(4)) and not set(r.ranks) & set(r.missing)
    assert not set(holders) & set(r.kill) and not set(r.spares) & set(r.kill)
    # every process is either kept (rank or spare) or killed
    assert set(holders) | set(r.spares) | set(r.kill) == {wid for wid, _, _ in claims}


def test_rebuild_goes_past_a_round_that_was_in_flight() -> None:
    # ranks already aborted for generation 3 would not report for it again
    procs = _procs((0, 0, "worker"), (1, 0, "worker"))
    workers = [WorkerReport(0, 0, 2, 9, aborted=3), WorkerReport(1, 1, 2, 9)]
    assert rebuild(procs, workers, nproc=2).generation == 4


# -- takeover: a fresh Coordinator set up from the rebuilt state -------------------------------
def _takeover(missing_rank: int | None = None) -> tuple[Any, list[Any]]:

    c = new_coordinator(4, 1)
    hosts = [
        TakeoverHost(0, "10.0.0.1", False),
        TakeoverHost(1, "10.0.0.2", True),
        TakeoverHost(2, "10.0.0.3", True),
    ]
    procs = [ProcReport(w, w // 2, "worker", 100 + w, f"10.0.0.{1 + w // 2}:{300 + w}") for w in range(4)]
    procs.append(ProcReport(4, 2, "spare", 104, "10.0.0.3:304"))
    workers = [WorkerReport(w, w, 2, 30, step=31) for w in range(4) if w != missing_rank]
    workers.append(WorkerReport(4, None, -1, -1, ready=True))
    rebuilt = rebuild(procs, workers, 4)
    resume(c, hosts, procs, workers, rebuilt, "coordinator lost", 50.0, 1e9, 51.0)
    return c, c.drain()


def test_takeover_aborts_every_rank_into_the_next_generation() -> None:

    c, out = _takeover()
    aborts = {
        cmd.worker_id: cmd.message for cmd in out if isinstance(cmd, Send) and isinstance(cmd.message, Abort)
    }
    assert sorted(aborts) == [0, 1, 2, 3] and {a.generation for a in aborts.values()} == {3}
    assert c.round is not None and c.round.target == 3 and not c.round.replace
    assert c.generation == 2 and c.next_worker_id == 5
    faults = [cmd.fields for cmd in out if isinstance(cmd, Emit) and cmd.event == "fault"]
    assert faults and faults[0]["kind"] == "coordinator_lost"


def test_takeover_kills_a_silent_rank_and_gives_its_rank_to_the_ready_spare() -> None:

    c, out = _takeover(missing_rank=2)
    assert [(k.worker_id, k.host) for k in out if isinstance(k, Kill)] == [(2, 1)]
    assert c.round is not None and c.round.replace == {2}
    for w in (0, 1, 3):
        c.on_message(w, Stopped(for_generation=3, committed_step=30, valid=True), 52.0, 1e9)
    c.tick(52.0, 1e9)
    assigned = [cmd for cmd in c.drain() if isinstance(cmd, Send) and isinstance(cmd.message, Assign)]
    assert [(a.worker_id, a.message.rank, a.message.generation) for a in assigned] == [(4, 2, 3)]


def test_takeover_before_the_first_generation_ends_the_job_with_the_reason() -> None:

    c = new_coordinator(1, 0)
    procs = [ProcReport(0, 0, "worker", 9)]
    workers = [WorkerReport(0, 0, -1, -1)]
    resume(
        c, [TakeoverHost(0, "h", False)], procs, workers, rebuild(procs, workers, 1), "lost", 1.0, 1e9, 2.0
    )
    stops = [cmd for cmd in c.drain() if isinstance(cmd, Stop)]
    assert stops and stops[0].code == 1 and "before generation 0 formed" in stops[0].why


def _takeover_after_the_end(missing: int | None = None) -> tuple[Coordinator, list[Any]]:
    """Two ranks whose last steps ran while no coordinator existed: their hellos say done."""
    c = new_coordinator(2, 1)
    procs = [ProcReport(w, 0, "worker", 100 + w) for w in range(2)] + [ProcReport(2, 0, "spare", 102)]
    workers = [WorkerReport(w, w, 0, 39, step=39, done=True) for w in range(2) if w != missing]
    workers.append(WorkerReport(2, None, -1, -1, ready=True))
    rebuilt = rebuild(procs, workers, 2)
    resume(c, [TakeoverHost(0, "h", False)], procs, workers, rebuilt, "lost", 1.0, 1e9, 2.0)
    return c, c.drain()


def test_takeover_after_every_rank_finished_ends_the_job_ok() -> None:
    # Seen in CI: the job's last steps ran while the successor was elected, and every rank's Done
    # went nowhere. Their hellos say they finished: nothing is aborted or replayed, each is told
    # its Done is recorded (it waits for that at its exit), and once they leave the job ends ok
    # (it failed as "lost before generation 0 formed" when they left before the rebuild).
    c, out = _takeover_after_the_end()
    assert not [cmd for cmd in out if isinstance(cmd, Stop)], "nothing ends it before they leave"
    told = [cmd for cmd in out if isinstance(cmd, Send)]
    assert {(cmd.worker_id, type(cmd.message)) for cmd in told} == {(0, DoneSeen), (1, DoneSeen)}, told
    assert c.round is None
    for w in range(2):
        c.on_closed(w)
        c.on_exit(w, 0, False, "exited with code 0", "", 2.1, 1e9)
    c.tick(2.2, 1e9)
    out = c.drain()
    ends = [cmd.fields for cmd in out if isinstance(cmd, Emit) and cmd.event == "job_end"]
    assert ends and ends[0]["status"] == "ok", out
    assert any(isinstance(cmd, Stop) and cmd.code == 0 for cmd in out)
    assert not [cmd for cmd in out if isinstance(cmd, Emit) and cmd.event == "fault"]


def test_takeover_after_the_end_with_a_rank_lost_fails_at_once_and_says_why() -> None:
    # a rank lost with the coordinator's host after the last step: no peer is left in the loop
    # to rebuild it from, and its work after the loop never ran; the job fails now, with why,
    # not after --spare-wait with a spare that can never recover
    _, out = _takeover_after_the_end(missing=1)
    stops = [cmd for cmd in out if isinstance(cmd, Stop)]
    assert (
        stops and stops[0].code == 1 and "lost with the coordinator after training finished" in stops[0].why
    )
    assert not [cmd for cmd in out if isinstance(cmd, Send) and isinstance(cmd.message, Assign | Abort)]


@pytest.mark.parametrize("code", [0, 1])
def test_takeover_after_every_rank_left_ends_the_job_with_their_status(code: int) -> None:
    # every rank finished and left (each one's Done acknowledged) just before the coordinator was
    # lost: no process is left, and their agents' votes say which ranks finished, with what exit
    # code; it failed as "lost before generation 0 formed" before the agents said so
    c = new_coordinator(3, 1)
    procs = [ProcReport(3, 0, "spare", 103)]
    workers = [WorkerReport(3, None, -1, -1, ready=True), WorkerReport(2, 2, 0, 39, done=True)]
    procs.append(ProcReport(2, 1, "worker", 102))
    left = [Finished(0, 0, 0, 0), Finished(1, 0, 1, code)]
    rebuilt = rebuild(procs, workers, 3, left)
    assert rebuilt.formed and rebuilt.missing == [] and sorted(rebuilt.finished) == [0, 1]
    resume(c, [TakeoverHost(0, "h", False)], procs, workers, rebuilt, "lost", 1.0, 1e9, 2.0)
    out = c.drain()
    assert [(cmd.worker_id, type(cmd.message)) for cmd in out if isinstance(cmd, Send)] == [(2, DoneSeen)]
    c.on_closed(2)
    c.on_exit(2, 0, False, "exited with code 0", "", 2.1, 1e9)
    c.tick(2.2, 1e9)
    ends = [cmd.fields for cmd in c.drain() if isinstance(cmd, Emit) and cmd.event == "job_end"]
    assert [e["status"] for e in ends] == ["ok" if code == 0 else "failed"], ends


def test_launch_config_travels_to_the_agents_and_back() -> None:

    cfg = LaunchConfig(
        script="t.py", script_args=["--steps", "3"], nproc=4, run_dir=Path("/tmp/r"), lease=2.5
    )
    raw = config_to_json(cfg)

    back = config_from_json(json.loads(json.dumps(raw)) | {"a_field_from_a_newer_coordinator": 1})
    assert back.run_dir == Path("/tmp/r") and back.script_args == ["--steps", "3"] and back.lease == 2.5
    assert back.nproc == 4


# -- the majority a coordinator must keep --------------------------------------------------------
def test_a_coordinator_keeps_its_majority_through_one_dead_host() -> None:
    hosts = [HostSeen(0, False, True, 10.0), HostSeen(1, False, True, 10.0), HostSeen(2, True, True, 4.0)]
    assert membership(hosts, 10.0, 5.0) == [0, 1, 2]  # lost 6 s ago: still counted
    assert keeps_majority(hosts, 10.0, 5.0)  # 2 of 3
    assert membership(hosts, 15.0, 5.0) == [0, 1]  # two leases later it drops out


@settings(max_examples=300, deadline=None)
@given(
    st.integers(3, 9),
    st.data(),
)
def test_a_minority_side_never_keeps_a_majority_while_its_peers_go_silent_one_by_one(
    n: int, data: st.DataObject
) -> None:
    """The coordinator's side of a partition (a minority) hears the other side go silent at
    staggered times within one heartbeat interval; whatever order it declares them lost in,
    it must find no majority once every one of them is past its lease."""
    own = data.draw(st.sets(st.integers(0, n - 1), max_size=(n - 1) // 2))
    cut = 100.0
    last = {h: cut - data.draw(st.floats(0.0, 0.5)) for h in range(n) if h not in own}
    lease = 5.0
    now = max(last.values(), default=cut) + lease + 0.01
    # the coordinator may already have marked any of them lost (each when its lease ran out)
    lost = data.draw(st.sets(st.sampled_from(sorted(last)))) if last else set()
    hosts = [HostSeen(h, False, True, now) for h in own]
    hosts += [HostSeen(h, h in lost, True, t) for h, t in last.items()]
    assert not keeps_majority(hosts, now, lease)


# -- the run directory's record of the current coordinator (launcher/runfiles.py) ---------------


def test_the_coordinator_record_holds_the_newest_address_whole(tmp_path: Path) -> None:
    path = tmp_path / COORDINATOR_FILE
    assert recorded_coordinator(path) is None  # before any coordinator started
    record_coordinator(tmp_path, "10.0.0.1:29400")
    assert recorded_coordinator(path) == "10.0.0.1:29400"
    record_coordinator(tmp_path, "10.0.0.3:41234")  # a successor took over
    assert recorded_coordinator(path) == "10.0.0.3:41234"
    assert sorted(p.name for p in tmp_path.iterdir()) == [COORDINATOR_FILE]  # no temporary left
    assert path.stat().st_mode & 0o777 == 0o600


def test_only_the_recorded_coordinator_removes_the_record(tmp_path: Path) -> None:
    record_coordinator(tmp_path, "10.0.0.3:41234")
    forget_coordinator(tmp_path, "10.0.0.1:29400")  # the old one, stepping down, leaves it
    assert recorded_coordinator(tmp_path / COORDINATOR_FILE) == "10.0.0.3:41234"
    forget_coordinator(tmp_path, "10.0.0.3:41234")  # the job ends in the successor
    assert not (tmp_path / COORDINATOR_FILE).exists()
    forget_coordinator(tmp_path, "10.0.0.3:41234")  # nothing there: nothing to do


@pytest.mark.parametrize(
    "content",
    [b"", b"\n", b"10.0.0.1", b"10.0.0.1:", b":29400", b"10.0.0.1:0", b"10.0.0.1:70000", b"10.0.0.1:29x00",
     b"10.0.0.1 :29400", b"a" * 400 + b":1", b"\xff\xfe:29400"],
)  # fmt: skip
def test_a_record_that_is_not_an_address_is_ignored(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / COORDINATOR_FILE
    path.write_bytes(content)
    assert recorded_coordinator(path) is None
    assert recorded_coordinator(tmp_path) is None  # a directory, not a file


class _Coordinators:
    """Stands in for the network under agent/join.py's ``join``: which addresses welcome the
    agent, which refuse it, the rest are dead; every attempt is logged, and ``on_try`` may change
    the world (a successor's record appearing) as an attempt is made."""

    def __init__(self, welcome: frozenset[str] = frozenset(), refuse: frozenset[str] = frozenset()) -> None:
        self.welcome, self.refuse = welcome, refuse
        self.tried: list[str] = []
        self.on_try: Any = None

    def __call__(self, coordinator: tuple[str, int], secret: bytes, hello: Any, timeout: float) -> Any:
        address = f"{coordinator[0]}:{coordinator[1]}"
        self.tried.append(address)
        if self.on_try is not None:
            self.on_try(len(self.tried))
        if address in self.welcome:
            return ("joined", address)
        if address in self.refuse:
            raise Refused("hung up")
        raise ConnectionError("refused")


def _join(
    monkeypatch: pytest.MonkeyPatch,
    net: _Coordinators,
    targets: list[str],
    record: Path,
    timeout: float = 5.0,
) -> Any:
    from checkpointless.agent import join

    monkeypatch.setattr(join, "connect", net)
    return join.join(targets, b"s", None, timeout, record)  # type: ignore[arg-type]


def test_an_agent_tries_the_recorded_coordinator_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record_coordinator(tmp_path, "10.0.0.3:41234")  # the successor, as it took over
    net = _Coordinators(welcome=frozenset({"10.0.0.3:41234"}))
    got = _join(monkeypatch, net, ["10.0.0.1:29400"], tmp_path / COORDINATOR_FILE)
    assert got == ("joined", "10.0.0.3:41234") and net.tried == ["10.0.0.3:41234"]


def test_an_agent_sees_a_record_written_while_it_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # started between the coordinator's loss and its successor's record: the given address is
    # dead, the record still names it; the successor's record appears during the second try
    record_coordinator(tmp_path, "10.0.0.1:29400")
    net = _Coordinators(welcome=frozenset({"10.0.0.3:41234"}))
    net.on_try = lambda n: n == 2 and record_coordinator(tmp_path, "10.0.0.3:41234")
    got = _join(monkeypatch, net, ["10.0.0.1:29400"], tmp_path / COORDINATOR_FILE)
    assert got == ("joined", "10.0.0.3:41234")
    assert net.tried == ["10.0.0.1:29400", "10.0.0.1:29400", "10.0.0.3:41234"], net.tried


def test_an_agent_asks_no_refusing_coordinator_again_and_ignores_a_bad_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / COORDINATOR_FILE).write_text("not an address\n")
    net = _Coordinators(refuse=frozenset({"10.0.0.1:29400", "10.0.0.2:39000"}))
    got = _join(monkeypatch, net, ["10.0.0.1:29400", "10.0.0.2:39000"], tmp_path / COORDINATOR_FILE, 30.0)
    assert got is None and net.tried == ["10.0.0.1:29400", "10.0.0.2:39000"], net.tried


def test_an_agent_gives_up_on_dead_coordinators_at_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time as _time

    net = _Coordinators()
    net.on_try = lambda n: _time.sleep(0.05)
    t0 = _time.monotonic()
    got = _join(monkeypatch, net, ["10.0.0.1:29400"], tmp_path / COORDINATOR_FILE, 0.5)
    assert got is None and 0.5 <= _time.monotonic() - t0 < 2.0
    assert len(net.tried) >= 5 and set(net.tried) == {"10.0.0.1:29400"}


def test_an_agent_reads_how_the_job_ended_from_the_event_log_tail(tmp_path: Path) -> None:
    assert job_outcome(tmp_path) is None  # no event log
    log = tmp_path / "events.jsonl"
    lines = [json.dumps({"event": "commit", "step": i, "pad": "x" * 200}) for i in range(2000)]
    log.write_text("\n".join(lines) + "\n")
    assert job_outcome(tmp_path) is None  # a long job still running
    with open(log, "a") as f:
        f.write(json.dumps({"event": "job_end", "status": "ok", "recoveries": 2}) + "\n")
        f.write('{"event": "job_end", "status": "ok"')  # a torn last line, skipped
    assert job_outcome(tmp_path) == "ok"
    log.write_text(json.dumps({"event": "job_end", "status": "failed", "error": "x"}) + "\n")
    assert job_outcome(tmp_path) == "failed"


def test_a_rejoining_agent_stops_once_the_job_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointless.agent import join

    net = _Coordinators()
    monkeypatch.setattr(join, "connect", net)
    gone = [False]
    net.on_try = lambda n: gone.__setitem__(0, n >= 2)  # the secret goes during the second try
    got = join.join(["10.0.0.1:29400"], b"s", None, 60.0, None, lambda: gone[0])  # type: ignore[arg-type]
    assert got is None and len(net.tried) == 2, net.tried


class _Conn:
    """A connection as refuse_all sees one: it can only be hung up."""

    def __init__(self) -> None:
        self.hung_up = False

    def hang_up(self) -> None:
        self.hung_up = True


class _Server:
    def __init__(self) -> None:
        import queue

        self.inbox: queue.Queue[tuple[Any, dict[str, Any]]] = queue.Queue()


def test_a_kept_workers_next_report_is_kept_in_order_and_its_close_forgets_it() -> None:
    # A worker reconnects to the next candidate before that agent has noticed the loss, and its
    # interrupted step's Stopped follows the hello at once (seen in CI: the agent hung the
    # worker up for it; the worker's old hello, still kept, then made the winner count it as
    # reconnected and refuse its real reconnect as a second hello, until it gave up).
    from checkpointless.agent.failover import refuse_all

    server, early = _Server(), []  # type: ignore[var-annotated]
    w1, w2, other = _Conn(), _Conn(), _Conn()
    hello = {"type": "hello", "worker_id": 2, "term": 1}
    stopped = {"type": "stopped", "for_generation": 1}
    for conn, raw in ((w1, hello), (w1, stopped), (w2, {**hello, "worker_id": 3}), (other, stopped)):
        server.inbox.put((conn, raw))
    refuse_all(server, early, keep_s=5.0)  # type: ignore[arg-type]
    assert [(c, r["type"]) for _, c, r in early] == [(w1, "hello"), (w1, "stopped"), (w2, "hello")]
    assert not w1.hung_up and not w2.hung_up and other.hung_up  # a report with no hello before it
    server.inbox.put((w2, {"type": "_closed"}))
    refuse_all(server, early, keep_s=5.0)  # type: ignore[arg-type]
    assert [(c, r["type"]) for _, c, r in early] == [(w1, "hello"), (w1, "stopped")]
    refuse_all(server, early, keep_s=0.0)  # a lease later: the hello and its report go together
    assert early == [] and w1.hung_up


def test_a_lease_heartbeat_before_the_welcome_is_no_refusal() -> None:
    """Over a real control channel: a coordinator's lease thread may beat a connection before its
    welcome went out; the joining agent waits for the welcome instead of taking the beat for a
    refusal (seen in CI: "refused this agent (None)", and the agent gave the job up)."""
    import threading

    from checkpointless.agent.join import connect
    from checkpointless.launcher.control import ControlServer
    from checkpointless.protocol import AgentHeartbeat, AgentHello, AgentWelcome, decode, encode
    from checkpointless.protocol.agent_link import SHM_KEY_LABEL
    from checkpointless.wire import seal_value

    secret = b"a job secret"
    server = ControlServer("127.0.0.1", 0, secret)
    server.start()

    def coordinator() -> None:
        conn, raw = server.inbox.get(timeout=20)
        assert isinstance(decode(raw), AgentHello)
        conn.send(encode(AgentHeartbeat(0.0)))
        welcome = AgentWelcome(
            agent_id=0, job_id="j", control="127.0.0.1:1", run_dir="/tmp/r",
            shm_key=seal_value(secret, SHM_KEY_LABEL, b"k"), job=LaunchConfig(script="t.py"), term=0,
        )  # fmt: skip
        conn.send(encode(welcome))

    t = threading.Thread(target=coordinator, daemon=True)
    t.start()
    try:
        hello = AgentHello(
            host="127.0.0.1", pid=1, hostname="h", node="n", order=0, failover="", health=False
        )
        client, _, got = connect(server.address[:2], secret, hello, 20.0)
        client.close()
        assert got.agent_id == 0 and got.shm_key == "k"
    finally:
        t.join(20)
        server.stop()
