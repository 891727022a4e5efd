"""Degraded mode in the coordinator (issue 39): with no spare ready, a round shrinks the job (a
survivor holds the lost slot, the plan says so, every count treats the holder's word as its
slot's), and a spare that becomes ready later grows it back in a round of its own; below
--min-replicas the job waits for spares and then fails with the reason. Driven as the pure state
machine it is, as test_coordinator.py does."""

from __future__ import annotations

from typing import Any

import pytest

from checkpointless.coordinator import Command, Emit, Kill, Send, Spawn, Stop
from checkpointless.coordinator.rules.decisions import RecoveryPlan
from checkpointless.coordinator.rules.width import fold_held_slots
from checkpointless.protocol import (
    Abort,
    Assign,
    Committed,
    Heartbeat,
    Message,
    Recover,
    Recovered,
    SpareReady,
    Stopped,
)
from tests.helpers.coordinator import new_coordinator

pytestmark = pytest.mark.timeout(10)


class Job:
    """A 4-rank job with no spares, generation 0 formed, every rank at step 7."""

    def __init__(self, **cfg: Any) -> None:
        self.c = new_coordinator(4, 0, **cfg)
        self.now = 100.0
        self.log: list[Command] = []
        self.c.start(self.now)
        self.flush()
        for wid in range(4):
            assert self.c.on_connected(wid, self.now)
            self.flush()
        self.form(0, {r: r for r in range(4)}, committed=0)
        for wid in range(4):
            self.msg(wid, Heartbeat(step=7, progress_age=0.1))

    def flush(self) -> list[Command]:
        out = self.c.drain()
        for cmd in out:
            if isinstance(cmd, Spawn):
                self.c.on_started(cmd.worker_id, f"127.0.0.1:{30000 + cmd.worker_id}")
        self.log += out
        return out

    def tick(self, seconds: float = 0.01) -> list[Command]:
        self.now += seconds
        self.c.tick(self.now, 1e9 + self.now)
        return self.flush()

    def msg(self, wid: int, m: Message) -> list[Command]:
        self.c.on_message(wid, m, self.now, 1e9 + self.now)
        return self.flush()

    def sent(self, out: list[Command], kind: type[Message]) -> dict[int, list[Any]]:
        got: dict[int, list[Any]] = {}
        for c in out:
            if isinstance(c, Send) and isinstance(c.message, kind):
                got.setdefault(c.worker_id, []).append(c.message)
        return got

    def events(self, name: str) -> list[dict[str, Any]]:
        return [c.fields for c in self.log if isinstance(c, Emit) and c.event == name]

    def form(
        self, gen: int, reports: dict[int, int], committed: int, new: frozenset[int] = frozenset()
    ) -> Any:
        """Each worker in ``reports`` (worker -> rank) stops; the plan goes out once to each;
        every one recovers. Returns the plan."""
        out: list[Command] = []
        for wid in reports:
            valid = wid not in new
            out += self.msg(
                wid,
                Stopped(
                    for_generation=gen, committed_step=committed if valid else -1, valid=valid, cause="comm"
                ),
            )
        for _ in range(3):  # a round that shrinks sends its plan at the next tick
            out += self.tick()
            if self.sent(out, Recover):
                break
        plans = self.sent(out, Recover)
        assert sorted(plans) == sorted(reports), out
        assert all(len(p) == 1 for p in plans.values()), "a holder gets one plan, not one per slot"
        for wid in reports:
            self.msg(wid, Recovered(generation=gen))
        return next(iter(plans.values()))[0].plan


def test_no_spare_shrinks_then_a_ready_spare_grows_the_job_back() -> None:
    j = Job(when_no_spare="shrink")
    out = j.c.on_exit(2, -9, False, "terminated by SIGKILL", "", j.now, 1e9 + j.now) or []
    out = j.flush()
    assert sorted(j.sent(out, Abort)) == [0, 1, 3]
    out = j.tick()
    spawned = [c for c in out if isinstance(c, Spawn)]
    assert [s.role for s in spawned] == ["spare"], "the spare that will grow the job back is started"
    assert not j.sent(out, Assign), "no spare was ready: nobody takes rank 2"
    # whether the job has a mesh (which drops whole replica groups) is in the survivors' reports
    assert not j.events("width"), "the shrink waits for the survivors' reports"
    plan = j.form(1, {0: 0, 1: 1, 3: 3}, committed=7)
    (width,) = j.events("width")
    assert width["width"] == 3 and width["holders"] == [[2, 0]], width
    assert plan.holders == [[2, 0]] and plan.slots_of(0) == [0, 2]
    assert plan.target_step == 7 and plan.receivers == []
    assert j.c.generation == 1, "the degraded generation formed with 3 processes"
    # a commit of the holder counts for its slot: the recovery is reported once each committed
    for wid in (0, 1, 3):
        j.msg(wid, Committed(generation=1, step=7))
    assert len(j.events("recovery")) == 1
    assert [e["active"] for e in j.events("condition") if e["name"] == "degraded"] == [True]

    # the spare becomes ready: a round of its own takes slot 2 back, the holder is not killed
    spare = spawned[0].worker_id
    assert j.c.on_connected(spare, j.now)
    j.flush()
    j.msg(spare, SpareReady())
    out = j.tick()
    assert sorted(j.sent(out, Abort)) == [0, 1, 3] and j.events("grow")[0]["holder"] == 0
    out += j.tick()
    assign = j.sent(out, Assign)
    assert assign[spare][0].rank == 2
    assert not [c for c in j.log if isinstance(c, Kill) and c.worker_id == 0], "the holder lives on"
    plan = j.form(2, {0: 0, 1: 1, 3: 3, spare: 2}, committed=9, new=frozenset({spare}))
    assert plan.holders == [] and plan.receivers == [2] and plan.target_step == 9
    assert j.events("width")[-1]["width"] == 4
    assert [e["active"] for e in j.events("condition") if e["name"] == "degraded"] == [True, False]


def test_a_lost_holder_takes_its_held_slots_with_it() -> None:
    j = Job(when_no_spare="shrink")
    j.c.on_exit(2, -9, False, "terminated by SIGKILL", "", j.now, 1e9 + j.now)
    j.flush()
    j.tick()
    j.form(1, {0: 0, 1: 1, 3: 3}, committed=7)
    # the holder of slots 0 and 2 dies: both go to the two processes left, one each
    j.c.on_exit(0, -9, False, "terminated by SIGKILL", "", j.now, 1e9 + j.now)
    j.flush()
    j.tick()
    plan = j.form(2, {1: 1, 3: 3}, committed=7)
    assert j.events("width")[-1]["holders"] == [[0, 1], [2, 3]]
    assert plan.slots_of(1) == [0, 1] and plan.slots_of(3) == [2, 3]


def test_below_min_replicas_the_job_waits_then_fails_with_the_reason() -> None:
    j = Job(when_no_spare="shrink", min_replicas=4, spare_wait=5.0)
    j.c.on_exit(2, -9, False, "terminated by SIGKILL", "", j.now, 1e9 + j.now)
    j.flush()
    out = j.tick()
    assert [c.role for c in out if isinstance(c, Spawn)] == ["spare"]
    assert not j.events("width"), "3 replicas are fewer than --min-replicas 4: no shrinking"
    out = j.tick(6.0)
    stops = [c for c in j.log if isinstance(c, Stop)]
    assert stops, out
    assert "going on would leave 3 of 4 replicas, fewer than --min-replicas 4" in stops[0].why


def test_a_rank_lost_before_the_first_generation_formed_waits_for_a_spare_not_a_holder() -> None:
    # started, not formed: the initial round is still collecting its members
    c = new_coordinator(4, 0, when_no_spare="shrink", spare_wait=5.0)
    now = 100.0
    c.start(now)
    log = c.drain()
    for cmd in log:
        if isinstance(cmd, Spawn):
            c.on_started(cmd.worker_id, f"127.0.0.1:{30000 + cmd.worker_id}")
    for wid in range(4):
        assert c.on_connected(wid, now)
    c.on_exit(2, -9, False, "terminated by SIGKILL", "", now, 1e9 + now)
    for t in (now + 0.01, now + 6.0):
        c.tick(t, 1e9 + t)
        log += c.drain()
    widths = [x for x in log if isinstance(x, Emit) and x.event == "width"]
    assert not widths, "no survivor can hold a slot before the first generation formed"
    assert [x.role for x in log if isinstance(x, Spawn)].count("spare") >= 1, "a spare is started"
    (stop,) = [x for x in log if isinstance(x, Stop)]
    assert "before the job's first generation formed" in stop.why, stop.why


def test_fail_policy_fails_after_the_wait_as_before() -> None:
    j = Job(spare_wait=5.0, when_no_spare="fail")
    j.c.on_exit(2, -9, False, "terminated by SIGKILL", "", j.now, 1e9 + j.now)
    j.flush()
    j.tick()
    j.tick(6.0)
    (stop,) = [c for c in j.log if isinstance(c, Stop)]
    assert "--spares" in stop.why and "--spare-wait" in stop.why and not j.events("width")


def test_a_holder_one_step_behind_receives_once_for_itself_and_its_held_slot() -> None:
    """The holder had not committed the step its peers had when the slot was lost: it receives
    the state, once, as itself. Its held slot reports the holder's state too, and was a second
    receiver in the plan, which the sender streamed to and waited on for good (seen in a run
    of examples/train_gpt.py: every member stuck in the state transfer)."""
    j = Job(when_no_spare="shrink")
    j.c.on_exit(2, -9, False, "terminated by SIGKILL", "", j.now, 1e9 + j.now)
    j.flush()
    j.tick()
    out: list[Command] = []
    for wid, committed in ((0, 6), (1, 7), (3, 7)):
        out += j.msg(wid, Stopped(for_generation=1, committed_step=committed, valid=True, cause="comm"))
    out += j.tick()  # the shrink, now that the survivors have reported
    out += j.tick()
    plans = j.sent(out, Recover)
    assert sorted(plans) == [0, 1, 3]
    plan = plans[0][0].plan
    assert plan.target_step == 7 and plan.holders == [[2, 0]]
    assert plan.receivers == [0] and plan.source in (1, 3), plan
    assert plan.source_of() == {0: plan.source}


def test_a_held_slot_is_never_the_source_its_holder_sends() -> None:
    plan = RecoveryPlan(target_step=5, source=2, receivers=(1, 3), sources=((1, 2), (3, 2)))
    folded = fold_held_slots(plan, {2: 0, 3: 0})
    assert folded.source == 0 and folded.receivers == (1,) and folded.sources == ((1, 0),)
    assert fold_held_slots(plan, {}) is plan
    snap = RecoveryPlan(target_step=5, source=-1, receivers=(0, 1, 2, 3), from_snapshot=True)
    assert fold_held_slots(snap, {2: 0}).source == -1


def test_on_an_hsdp_mesh_the_lost_ranks_replica_group_leaves_whole() -> None:
    """A (2, 2) mesh loses rank 2: rank 3 (its replica group's other rank) is stopped, each slot
    of the group goes to the rank of the same shard coordinate, a spare is started per held
    slot, and only a whole group's worth of ready spares grows it back."""
    j = Job(when_no_spare="shrink")
    j.c.on_exit(2, -9, False, "terminated by SIGKILL", "", j.now, 1e9 + j.now)
    j.flush()
    j.tick()
    for wid in (0, 1, 3):
        j.msg(wid, Stopped(for_generation=1, committed_step=7, valid=True, cause="comm", mesh=[2, 2]))
    j.tick()
    (width,) = j.events("width")
    assert width["width"] == 2 and width["holders"] == [[2, 0], [3, 1]], width
    assert 3 in [c.worker_id for c in j.log if isinstance(c, Kill)], "rank 3 leaves with its group"
    spares = [c.worker_id for c in j.log if isinstance(c, Spawn) and c.role == "spare"]
    assert len(spares) == 2, "one spare for each held slot"
    out = j.tick()
    plans = j.sent(out, Recover)
    assert sorted(plans) == [0, 1] and plans[0][0].plan.holders == [[2, 0], [3, 1]]
    for wid in (0, 1):
        j.msg(wid, Recovered(generation=1))
    for wid in (0, 1):
        j.msg(wid, Committed(generation=1, step=7))
    # one spare ready brings nothing back: a replica group returns whole
    assert j.c.on_connected(spares[0], j.now)
    j.flush()
    j.msg(spares[0], SpareReady())
    j.tick()
    assert not j.events("grow")
    assert j.c.on_connected(spares[1], j.now)
    j.flush()
    j.msg(spares[1], SpareReady())
    j.tick()
    assert sorted(e["rank"] for e in j.events("grow")) == [2, 3]
