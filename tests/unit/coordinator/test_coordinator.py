"""The coordinator is a pure state machine: observations in, commands out. These tests drive it
through whole rounds with no process, socket or clock, and check the commands it returns."""

from __future__ import annotations

from typing import Any

import pytest

from checkpointless.coordinator import Command, Emit, HostTable, Kill, Log, Send, Spawn, Stop
from checkpointless.coordinator.coordinator import EXIT_GRACE_S
from checkpointless.coordinator.downtime import transfer_parts
from checkpointless.peer_table import TableChunk, assemble, table_digest
from checkpointless.protocol import (
    Abort,
    Assign,
    Committed,
    Done,
    DoneSeen,
    Fatal,
    Heartbeat,
    Message,
    PeerTable,
    Recover,
    Recovered,
    Shutdown,
    SpareReady,
    Stopped,
)
from tests.helpers.coordinator import new_coordinator

pytestmark = pytest.mark.timeout(10)


class Harness:
    """Feeds the coordinator and plays the shell: spawns get an address, time only moves when told."""

    def __init__(self, nproc: int = 3, spares: int = 1, **cfg: Any) -> None:
        self.c = new_coordinator(nproc, spares, **cfg)
        self.now = 100.0
        self.log: list[Command] = []
        self.c.start(self.now)
        self.flush()

    def flush(self) -> list[Command]:
        out = self.c.drain()
        for cmd in out:
            if isinstance(cmd, Spawn):
                self.c.on_started(cmd.worker_id, f"127.0.0.1:{30000 + cmd.worker_id}")
        self.log += out
        return out

    def advance(self, seconds: float) -> list[Command]:
        self.now += seconds
        self.c.tick(self.now, 1e9 + self.now)
        return self.flush()

    def msg(self, wid: int, m: Message) -> list[Command]:
        self.c.on_message(wid, m, self.now, 1e9 + self.now)
        return self.flush()

    def connect(self, wid: int) -> list[Command]:
        assert self.c.on_connected(wid, self.now)
        return self.flush()

    def closed(self, wid: int) -> list[Command]:
        self.c.on_closed(wid)
        return self.flush()

    def exit(
        self, wid: int, code: int, own: bool = False, detail: str = "terminated by SIGKILL"
    ) -> list[Command]:
        self.c.on_exit(wid, code, own, detail, "", self.now, 1e9 + self.now)
        return self.flush()

    def sent(self, out: list[Command], kind: type[Message]) -> dict[int, Any]:
        return {c.worker_id: c.message for c in out if isinstance(c, Send) and isinstance(c.message, kind)}

    def events(self, name: str) -> list[dict[str, Any]]:
        return [c.fields for c in self.log if isinstance(c, Emit) and c.event == name]

    def form_generation(
        self, gen: int, ranks: dict[int, int], committed: int, receivers: set[int] = frozenset()
    ) -> None:
        """Every member reports, the plan goes out, everyone recovers."""
        out: list[Command] = []
        for rank, wid in ranks.items():
            valid = rank not in receivers
            out += self.msg(
                wid,
                Stopped(
                    for_generation=gen,
                    committed_step=committed if valid else -1,
                    valid=valid,
                    cause="start" if gen == 0 else "comm",
                ),
            )
        out += self.advance(0.01)
        plans = self.sent(out, Recover)
        assert set(plans) == set(ranks.values()), out
        for wid in ranks.values():
            self.msg(wid, Recovered(generation=gen))


def start_job(h: Harness) -> None:
    spawns = [c for c in h.log if isinstance(c, Spawn)]
    assert [(s.worker_id, s.role) for s in spawns] == [(0, "worker"), (1, "worker"), (2, "worker")]
    for wid in range(3):
        out = h.connect(wid)
        assign = h.sent(out, Assign)[wid]
        assert (assign.rank, assign.world_size, assign.generation) == (wid, 3, 0)
    h.form_generation(0, {0: 0, 1: 1, 2: 2}, committed=0)
    assert h.events("started"), "generation 0 formed"
    spare = [c for c in h.log if isinstance(c, Spawn) and c.role == "spare"]
    assert [s.worker_id for s in spare] == [3], "the spare pool fills once generation 0 has formed"
    h.connect(3)
    h.msg(3, SpareReady())


def test_a_killed_rank_is_replaced_by_the_ready_spare_and_receives_state() -> None:
    h = Harness()
    start_job(h)
    for wid in range(3):
        h.msg(wid, Heartbeat(step=7, progress_age=0.1))
    out = h.exit(1, -9)
    faults = h.events("fault")
    assert faults[-1]["rank"] == 1 and faults[-1]["kind"] == "killed" and faults[-1]["step"] == 7
    aborts = h.sent(out, Abort)
    assert set(aborts) == {0, 2} and all(a.generation == 1 for a in aborts.values())
    out += h.advance(0.01)
    assign = h.sent(out, Assign)
    assert assign[3].rank == 1 and assign[3].generation == 1, "the ready spare takes rank 1"
    assert any(isinstance(c, Spawn) and c.role == "spare" for c in out), "the pool is refilled"
    out = []
    for wid, committed, valid in ((0, 7, True), (2, 7, True), (3, -1, False)):
        out += h.msg(wid, Stopped(for_generation=1, committed_step=committed, valid=valid))
    out += h.advance(0.01)
    plan = next(iter(h.sent(out, Recover).values())).plan
    assert plan.target_step == 7 and plan.source == 0 and plan.receivers == [1]
    # the peer table travels as a delta to the survivors, whole (in chunks) to the spare's host,
    # whose agent keeps it for the spare (agent/tables.py); nothing whole to a member
    recovers = h.sent(out, Recover)
    assert recovers[0].moved_ranks == [1] and recovers[0].moved_to == ["127.0.0.1:30003"]
    assert "peers" not in recovers[0].rendezvous
    assert not h.sent(out, PeerTable)
    (copy,) = [c for c in out if isinstance(c, HostTable)]
    first_plan = min(i for i, c in enumerate(out) if isinstance(c, Send) and isinstance(c.message, Recover))
    assert copy.host == 0 and out.index(copy) < first_plan, "the host's copy goes out before the plans"

    chunks = list(copy.chunks)
    assert all(c.version == recovers[3].table_version for c in chunks)
    table = assemble([TableChunk(c.first, c.hosts, c.runs) for c in chunks], 3)
    assert table == ["127.0.0.1:30000", "127.0.0.1:30003", "127.0.0.1:30002"], "rank 1 is the spare now"
    assert table_digest(table) == recovers[3].table_digest == recovers[0].table_digest
    for wid in (0, 2, 3):
        h.msg(wid, Recovered(generation=1, timings={"rebuild_s": 0.01}))
    assert not h.events("recovery"), "reported once every rank has committed a step"
    for wid in (0, 2, 3):
        h.advance(0.1)
        h.msg(wid, Committed(generation=1, step=7))
    rec = h.events("recovery")
    assert len(rec) == 1 and rec[0]["first_step_s"] is not None and rec[0]["downtime_s"] > 0


def test_a_spare_given_a_rank_has_the_first_step_allowance_to_set_up() -> None:
    # The spare runs the script's set-up after init() before it reports (moving the model,
    # fully_shard, the optimizer): longer than the hang limit (10 s) is not a hang. A survivor
    # that never leaves its step is one.
    h = Harness(first_step_timeout=120.0)
    start_job(h)
    for wid in range(3):
        h.msg(wid, Heartbeat(step=7, progress_age=0.1))
    out = h.exit(1, -9)
    out += h.advance(0.01)
    assert h.sent(out, Assign)[3].rank == 1
    h.msg(0, Stopped(for_generation=1, committed_step=7, valid=True))
    h.msg(2, Stopped(for_generation=1, committed_step=7, valid=True))
    for _ in range(12):  # 60 s of set-up, every process's heartbeat going
        for wid in (0, 2, 3):
            h.msg(wid, Heartbeat(step=None if wid == 3 else 7, progress_age=0.1))
        out = h.advance(5.0)
        assert not [c for c in out if isinstance(c, Kill)], "the spare was killed while setting up"
    out = h.msg(3, Stopped(for_generation=1, committed_step=-1, valid=False))
    out += h.advance(0.01)
    assert h.sent(out, Recover), "the round went on once the spare reported"
    # past the allowance it is killed, and says why
    h2 = Harness(first_step_timeout=30.0)
    start_job(h2)
    h2.exit(1, -9)
    h2.advance(0.01)
    h2.msg(0, Stopped(for_generation=1, committed_step=7, valid=True))
    h2.msg(2, Stopped(for_generation=1, committed_step=7, valid=True))
    killed: list[Kill] = []
    for _ in range(10):
        for wid in (0, 2, 3):
            h2.msg(wid, Heartbeat(step=None if wid == 3 else 7, progress_age=0.1))
        killed += [c for c in h2.advance(5.0) if isinstance(c, Kill)]
    assert [k.worker_id for k in killed] == [3], killed
    assert "did not report after it was given its rank within 30.0 s" in killed[0].why


def _fault_from_snapshot(h: Harness, gen: int, step: int) -> None:
    # every rank's state was lost: each reports invalid, the plan restores the snapshot of step 5
    h.msg(1, Stopped(for_generation=0, committed_step=step, valid=False, cause="exception", step=step))
    for wid in range(3):
        h.msg(wid, Stopped(for_generation=gen, committed_step=-1, valid=False, snapshot_step=5, step=step))
    out = h.advance(0.01)
    plans = h.sent(out, Recover)
    assert plans and all(p.plan.target_step == 5 for p in plans.values()), out
    for wid in range(3):
        h.msg(wid, Recovered(generation=gen))


def test_faults_at_later_steps_are_progress_though_each_restores_the_same_snapshot() -> None:
    # snapshots every 50 steps, faults at 6, 7, 8, 9 (the job trains past each between them):
    # every plan restores step 5, and none of that is a loop
    h = Harness(max_step_failures=2, spares=0)
    start_job_without_spares(h)
    for gen, step in enumerate((6, 7, 8, 9), start=1):
        _fault_from_snapshot(h, gen, step)
    assert h.c.stopping is None
    # the same step failing each time is: the job ends on the third (with fresh-process retries
    # off; test_respawn.py has them on)
    h = Harness(max_step_failures=2, spares=0, fresh_process_retries=0)
    start_job_without_spares(h)
    _fault_from_snapshot(h, 1, 6)
    _fault_from_snapshot(h, 2, 6)
    with pytest.raises(AssertionError):  # no plan goes out: the job ends instead
        _fault_from_snapshot(h, 3, 6)
    assert h.c.stopping is not None
    assert any(isinstance(c, Log) and "faults keep recurring at step 5" in c.text for c in h.log)


def test_every_round_is_reported_even_when_the_job_ends_first() -> None:
    h = Harness()
    start_job(h)
    h.exit(2, -9)
    h.advance(0.01)
    for wid, committed, valid in ((0, 9, True), (1, 9, True), (3, -1, False)):
        h.msg(wid, Stopped(for_generation=1, committed_step=committed, valid=valid))
    h.advance(0.01)
    for wid in (0, 1, 3):
        h.msg(wid, Recovered(generation=1))
    # the job was already at its last step: every rank finishes without committing another
    for wid in (0, 1, 3):
        h.msg(wid, Done(step=9))
        h.c.on_exit(wid, 0, False, "exited with code 0", "", h.now, 0)
    out = h.advance(0.01)
    rec = h.events("recovery")
    assert len(rec) == 1 and rec[0]["first_step_s"] is None and "ended" in rec[0]["incomplete"]
    end = h.events("job_end")[-1]
    assert end["status"] == "ok" and end["recoveries"] == 1 and end["faults"] == 1
    assert any(isinstance(c, Stop) and c.code == 0 for c in out)


def test_a_moving_fault_exhausts_the_budget_and_stops_with_one_line() -> None:
    # with fresh-process retries off: the job stops at the budget (test_respawn.py: with them on)
    h = Harness(fresh_process_retries=0)
    start_job(h)
    out: list[Command] = []
    for gen, step in enumerate(range(11, 16), start=1):
        out += h.msg(
            1,
            Stopped(
                for_generation=gen,
                committed_step=step,
                valid=True,
                cause="exception",
                error=f"ValueError: bad row {step}",
                step=step,
            ),
        )
        if h.c.stopping:
            break
        for wid in (0, 2):
            h.msg(wid, Stopped(for_generation=gen, committed_step=step, valid=True))
        h.advance(0.01)
        for wid in (0, 1, 2):
            h.msg(wid, Recovered(generation=gen))
    stops = [c for c in h.log if isinstance(c, Stop)]
    assert len(stops) == 1 and stops[0].code == 1
    assert "rank 1 failed 4 times with exception" in stops[0].why and "bad row 14" in stops[0].why
    assert h.events("job_end")[-1]["recoveries"] == 3
    assert {wid for wid, m in h.sent(h.log, Shutdown).items()} >= {0, 1, 2, 3}, "every process is told"


def test_spares_that_die_before_ready_end_the_job_naming_the_cause() -> None:
    h = Harness(max_start_failures=3)
    start_job(h)
    h.exit(3, 1, own=True, detail="exited with code 1")  # it had been ready: not a start failure
    h.closed(3)  # (its connection's end: a process that exited itself is judged then)
    h.exit(4, 1, own=True, detail="exited with code 1: ImportError: no module named foo")
    h.exit(5, 1, own=True, detail="exited with code 1: ImportError: no module named foo")
    assert not h.c.stopping
    h.exit(6, 1, own=True, detail="exited with code 1: ImportError: no module named foo")
    stop = [c for c in h.log if isinstance(c, Stop)]
    assert stop and "3 spare processes in a row failed" in stop[0].why and "ImportError" in stop[0].why


def test_spares_killed_from_outside_do_not_use_up_the_budget() -> None:
    h = Harness(max_start_failures=2)
    start_job(h)
    for wid in (3, 4, 5, 6):
        h.exit(wid, -9, own=False)
    assert not h.c.stopping
    assert len([c for c in h.log if isinstance(c, Spawn) and c.role == "spare"]) == 5


def test_a_silent_rank_is_killed_but_ranks_waiting_for_it_are_not() -> None:
    h = Harness(hang_timeout=5.0)
    start_job(h)
    for wid in (0, 2):
        h.msg(wid, Heartbeat(step=4, progress_age=0.0, in_collective=True))
    h.msg(1, Heartbeat(step=4, progress_age=0.0))
    out: list[Command] = []
    for _ in range(6):  # ranks 0 and 2 keep talking, rank 1 has gone quiet
        out += h.advance(1.0)
        for wid in (0, 2):
            h.msg(wid, Heartbeat(step=4, progress_age=0.5, in_collective=True))
    kills = [c for c in out if isinstance(c, Kill)]
    assert [k.worker_id for k in kills] == [1] and "no heartbeat" in kills[0].why
    assert any(isinstance(c, Log) and "rank 1 is hung" in c.text for c in out)


def test_a_stopped_process_reported_by_the_agent_is_killed_once() -> None:
    h = Harness()
    start_job(h)
    h.c.on_verdict(2, "stopped (process state T for 0.5 s)", h.now)
    h.c.on_verdict(2, "stopped (process state T for 0.6 s)", h.now)
    kills = [c for c in h.flush() if isinstance(c, Kill)]
    assert [k.worker_id for k in kills] == [2]
    h.exit(2, -9)
    fault = h.events("fault")[-1]
    assert fault["kind"] == "hang" and fault["rank"] == 2


def test_a_second_hello_or_an_unknown_worker_is_refused() -> None:
    h = Harness()
    assert h.c.on_connected(0, h.now)
    assert not h.c.on_connected(0, h.now), "a replayed hello must not take over a worker"
    assert not h.c.on_connected(99, h.now)


def test_a_fault_before_the_first_generation_forms_is_named_by_start_up() -> None:
    h = Harness()
    for wid in range(3):
        h.connect(wid)
    h.msg(0, Stopped(for_generation=0, committed_step=0, valid=True, cause="start"))
    out = h.exit(1, -9)  # dies before it reported: generation 0 never forms
    out += h.advance(0.01)
    new = [c.worker_id for c in out if isinstance(c, Spawn)]
    assert new, "a replacement for rank 1 is started"
    h.connect(new[0])
    out = h.msg(new[0], SpareReady())
    out += h.advance(0.01)
    assert h.sent(out, Assign)[new[0]].rank == 1
    h.form_generation(0, {0: 0, 1: new[0], 2: 2}, committed=0)
    started = h.events("started")
    assert len(started) == 1 and [(f["rank"], f["kind"]) for f in started[0]["faults"]] == [(1, "killed")]
    assert not h.events("recovery"), "no step was lost: start-up absorbed the fault"
    for wid in (0, new[0], 2):
        h.msg(wid, Done(step=10))
        h.c.on_exit(wid, 0, False, "exited with code 0", "", h.now, 0)
    h.advance(0.01)
    end = h.events("job_end")
    assert end and end[0]["faults"] == 1 and end[0]["startup_faults"] == 1, end


def test_settled_only_while_nothing_is_in_flight() -> None:
    # the launcher's loop slows down while settled (policy.loop_wait): never during a start,
    # a round, or an exit that waits for its connection's end
    h = Harness()
    assert not h.c.settled(), "starting: the first round is in flight until everyone joined"
    start_job(h)
    assert h.c.settled()
    h.exit(1, -9)
    assert not h.c.settled(), "a killed rank starts a round"
    h2 = Harness(spares=0)
    start_job_without_spares(h2)
    assert h2.c.settled()
    h2.exit(0, 0, detail="exited with code 0")  # its Done may still be unread
    assert not h2.c.settled()


def test_a_clean_exit_seen_before_its_done_is_read_is_not_a_fault() -> None:
    # The process table can report a finished rank's exit before the control connection's last
    # frames are read (the CI run that found this: 'FAULT rank 0: exit (exited with code 0)').
    h = Harness(spares=0)
    start_job_without_spares(h)
    h.exit(0, 0, detail="exited with code 0")  # Done still unread
    assert not h.events("fault"), "no verdict before its connection has ended"
    h.msg(0, Done(step=9))
    h.closed(0)
    for wid in (1, 2):
        h.msg(wid, Done(step=9))
        h.closed(wid)
        h.exit(wid, 0, detail="exited with code 0")
    out = h.advance(0.01)
    end = h.events("job_end")
    assert end and end[0]["status"] == "ok" and end[0]["faults"] == 0, end
    assert any(isinstance(c, Stop) and c.code == 0 for c in out)
    assert not h.events("fault")


def test_a_clean_exit_without_done_is_a_fault_once_its_connection_ends_or_the_grace_runs_out() -> None:
    h = Harness(spares=0)
    start_job_without_spares(h)
    h.exit(0, 0, detail="exited with code 0")
    h.closed(0)  # its connection ended with no Done: it left the loop early
    assert [f["rank"] for f in h.events("fault")] == [0]
    h.exit(1, 0, detail="exited with code 0")  # something still holds its socket open
    h.advance(EXIT_GRACE_S / 2)
    assert [f["rank"] for f in h.events("fault")] == [0]
    h.advance(EXIT_GRACE_S)
    assert [f["rank"] for f in h.events("fault")] == [0, 1]


def test_a_fatal_error_read_after_its_exit_still_ends_the_job() -> None:
    h = Harness(spares=0)
    start_job_without_spares(h)
    h.exit(1, 1, detail="exited with code 1")  # its Fatal is still in the socket
    out = h.msg(1, Fatal(error="step 4 raised ValueError 3 times in a row"))
    out += h.closed(1)
    assert not h.events("fault"), "a fatal error is the job's end, not a fault to recover"
    stop = [c for c in out if isinstance(c, Stop)]
    assert stop and stop[0].code != 0 and "3 times in a row" in stop[0].why, out


def start_job_without_spares(h: Harness) -> None:
    for wid in range(3):
        h.connect(wid)
    h.form_generation(0, {0: 0, 1: 1, 2: 2}, committed=0)
    assert h.events("started")


def test_transfer_parts_name_the_slowest_receiver() -> None:
    src = {"role": "source", "transfer_s": 0.9, "layout_s": 0.01, "send_s": 0.7}
    fast = {"role": "receiver", "transfer_s": 0.3, "recv_s": 0.2, "verify_s": 0.05}
    slow = {"role": "receiver", "transfer_s": 0.5, "state_collect_s": 0.01, "recv_s": 0.3, "verify_s": 0.1}
    slow["state_restore_s"] = 0.08
    got = transfer_parts({0: src, 1: fast, 2: slow, 3: {"role": "none", "transfer_s": 2.0}})
    assert got == {
        "rank": 2,
        "role": "receiver",
        "state_collect_s": 0.01,
        "recv_s": 0.3,
        "verify_s": 0.1,
        "state_restore_s": 0.08,
    }
    assert transfer_parts({0: src, 3: {"role": "undo", "transfer_s": 0.1}}) is None


def test_a_round_open_when_every_rank_has_finished_ends_the_job() -> None:
    # A coordinator that took over as the last steps ran (seen in CI: the election took a second
    # and the job's 33 remaining steps were done by then) opens a round; every rank, already
    # past its last step, sends Done and exits instead of reporting. The job is complete:
    # nothing is left to recover, and it must end now, not fail at --recovery-timeout.
    h = Harness(spares=0)
    start_job_without_spares(h)
    h.msg(0, Stopped(for_generation=1, committed_step=9, valid=True, cause="comm"))
    h.advance(0.01)
    assert h.c.round is not None, "a round is open"
    for wid in range(3):
        h.msg(wid, Done(step=39))
        h.closed(wid)
        h.exit(wid, 0, detail="exited with code 0")
    out = h.advance(0.01)
    end = h.events("job_end")
    assert end and end[0]["status"] == "ok", (end, h.events("fault"))
    assert any(isinstance(c, Stop) and c.code == 0 for c in out)


def test_a_rank_working_after_its_loop_is_not_judged_hung() -> None:
    # After Done a rank runs the script's own code (saving the model, an evaluation) for as long
    # as it takes: it makes no step progress by design, and killing it as hung (it was, after the
    # hang limit) failed a finished job. Its Done is acknowledged (DoneSeen) at once.
    h = Harness(spares=0)
    start_job_without_spares(h)
    seen = {}
    for wid in range(3):
        seen.update(h.sent(h.msg(wid, Done(step=39)), DoneSeen))
    assert sorted(seen) == [0, 1, 2]
    for i in range(1, 121):  # two minutes of heartbeats without progress, past every limit
        for wid in range(3):
            h.msg(wid, Heartbeat(step=39, progress_age=0.5 * i, step_time=0.05))
        assert not [c for c in h.advance(0.5) if isinstance(c, Kill)], f"killed after {0.5 * i} s"
    for wid in range(3):
        h.closed(wid)
        h.exit(wid, 0, detail="exited with code 0")
    h.advance(0.01)
    assert [e["status"] for e in h.events("job_end")] == ["ok"]


def test_a_rank_lost_after_the_others_finished_fails_the_job_at_once_and_says_why() -> None:
    # rank 2 dies after ranks 0 and 1 have left the loop: no peer is left to rebuild it from, so
    # the job fails on the next tick with the reason, not after --spare-wait or
    # --recovery-timeout; the finished ranks are not aborted out of their own code
    h = Harness(spares=0)
    start_job_without_spares(h)
    for wid in (0, 1):
        h.msg(wid, Done(step=39))
    out = h.exit(2, -9)
    assert not h.sent(out, Abort), "a finished rank is not aborted"
    out = h.advance(0.01)
    stops = [c for c in out if isinstance(c, Stop)]
    assert stops and stops[0].code != 0 and "lost after training finished" in stops[0].why, out


def test_a_rank_caught_in_the_final_barrier_after_another_finished_fails_at_once() -> None:
    # a round's abort reaches rank 2 inside the final barrier just after ranks 0 and 1 passed it
    # and sent Done: rank 2 stops and waits for a plan that cannot form without them; the job
    # says so now instead of at --recovery-timeout
    h = Harness(spares=0)
    start_job_without_spares(h)
    h.msg(2, Stopped(for_generation=1, committed_step=39, valid=True, cause="comm"))
    for wid in (0, 1):
        h.msg(wid, Done(step=39))
    out = h.advance(0.01)
    stops = [c for c in out if isinstance(c, Stop)]
    assert stops and stops[0].code != 0 and "[2] were interrupted after training finished" in stops[0].why


def test_no_plan_goes_out_before_every_rank_has_a_key_server_address() -> None:
    """A worker's hello can come before its agent's ProcStarted (two connections, a busy host):
    the plan waits for the address, or its peers would get '' to rendezvous with."""
    c = new_coordinator(3, 0)
    c.start(100.0)
    spawns = [x for x in c.drain() if isinstance(x, Spawn)]
    for s in spawns[:2]:
        c.on_started(s.worker_id, f"127.0.0.1:{30000 + s.worker_id}")
    for s in spawns:
        assert c.on_connected(s.worker_id, 100.0)
        c.on_message(
            s.worker_id, Stopped(for_generation=0, committed_step=0, valid=True, cause="start"), 100.0, 1e9
        )
    c.tick(100.1, 1e9)
    plans = [x for x in c.drain() if isinstance(x, Send) and isinstance(x.message, Recover)]
    assert plans == [], "a plan went out without rank 2's address"
    c.on_started(spawns[2].worker_id, "127.0.0.1:30002")
    c.tick(100.2, 1e9)
    plans = [x for x in c.drain() if isinstance(x, Send) and isinstance(x.message, Recover)]
    assert {p.worker_id for p in plans} == {0, 1, 2}, plans
