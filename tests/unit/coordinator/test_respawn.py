"""Fresh-process retries in the coordinator: once a step's in-process retries are used up, the
raising rank goes to a fresh process (a spare), once; a fresh process that raises there again ends
the job, saying so (the rules: test_respawn_rules.py)."""

from __future__ import annotations

import pytest

from checkpointless.coordinator import Kill, Spawn, Stop
from checkpointless.protocol import Assign, Fatal, Fired, FiredSeen, Recover, Recovered, SpareReady, Stopped
from tests.unit.coordinator.test_coordinator import Harness, start_job, start_job_without_spares

pytestmark = pytest.mark.timeout(10)


def raised(h: Harness, wid: int, gen: int, step: int, error: str = "ValueError: bad row") -> None:
    h.msg(
        wid,
        Stopped(
            for_generation=gen, committed_step=step, valid=True, cause="exception", error=error, step=step
        ),
    )


def survivors_report(h: Harness, gen: int, step: int, wids: tuple[int, ...] = (0, 2)) -> None:
    for wid in wids:
        h.msg(wid, Stopped(for_generation=gen, committed_step=step, valid=True))


def stop_of(h: Harness) -> Stop | None:
    return next((c for c in h.log if isinstance(c, Stop)), None)


def test_the_budget_spent_on_an_exception_hands_the_rank_to_a_fresh_process_once() -> None:
    h = Harness()
    start_job(h)
    for gen in (1, 2, 3):  # rank 1 raises at step 5, and is retried in its process
        raised(h, 1, gen, 5)
        survivors_report(h, gen, 5)
        assert h.sent(h.advance(0.01), Recover), "an in-process retry"
        for wid in (0, 1, 2):
            h.msg(wid, Recovered(generation=gen))
    raised(h, 1, 4, 5)  # the 4th: past --max-repeat-faults 3
    survivors_report(h, 4, 5)
    out = h.advance(0.01)
    assert stop_of(h) is None, stop_of(h)
    assert not h.sent(out, Recover), "no plan before the fresh process has reported"
    assert h.sent(out, Assign)[3].rank == 1, "the ready spare takes rank 1"
    assert [k.worker_id for k in out if isinstance(k, Kill)] == [1], "the old process is stopped"
    [ev] = h.events("respawn")
    assert (ev["ranks"], ev["step"], ev["retries"]) == ([1], 5, 3), ev
    h.msg(3, Stopped(for_generation=4, committed_step=-1, valid=False))
    plans = h.sent(h.advance(0.01), Recover)
    assert plans and plans[3].plan.target_step == 5 and 1 in plans[3].plan.receivers
    for wid in (0, 2, 3):
        h.msg(wid, Recovered(generation=4))
    # the fresh process raises at step 5 too: the script's bug
    raised(h, 3, 5, 5, "ZeroDivisionError: a bug")
    stop = stop_of(h)
    assert stop is not None and stop.code == 1
    assert "rank 1 raised at step 5 again in a fresh process: ZeroDivisionError: a bug" in stop.why
    assert "retried in process 3 times and once in a fresh process" in stop.why


def test_a_fresh_process_that_trains_on_has_cured_the_fault() -> None:
    h = Harness(max_repeat_faults=1)
    start_job(h)
    raised(h, 1, 1, 5)
    survivors_report(h, 1, 5)
    h.advance(0.01)
    for wid in (0, 1, 2):
        h.msg(wid, Recovered(generation=1))
    raised(h, 1, 2, 5)
    survivors_report(h, 2, 5)
    h.advance(0.01)
    assert h.events("respawn") and stop_of(h) is None
    h.msg(3, Stopped(for_generation=2, committed_step=-1, valid=False))
    h.advance(0.01)
    for wid in (0, 2, 3):
        h.msg(wid, Recovered(generation=2))
    # much later another rank raises once: an ordinary fault, retried in its process
    raised(h, 2, 3, 40)
    survivors_report(h, 3, 40, wids=(0, 3))
    assert h.sent(h.advance(0.01), Recover) and stop_of(h) is None


def test_a_workers_own_limit_ends_its_process_and_a_spare_takes_the_rank() -> None:
    h = Harness()
    start_job(h)
    for gen in (1, 2, 3):
        raised(h, 1, gen, 5)
        survivors_report(h, gen, 5)
        h.advance(0.01)
        for wid in (0, 1, 2):
            h.msg(wid, Recovered(generation=gen))
    # the 4th raise: the worker's init(max_step_retries=3) is spent, it says so and exits
    h.msg(
        1,
        Fatal(
            error="step 5 raised ValueError 4 times in a row (bad row); this is not a transient fault",
            kind="retries",
        ),
    )
    assert stop_of(h) is None, stop_of(h)
    [ev] = h.events("respawn")
    assert (ev["ranks"], ev["step"], ev["retries"]) == ([1], 5, 3), ev
    h.exit(1, 1, own=True, detail="exited with code 1")
    h.closed(1)
    out = h.advance(0.01)
    assert h.sent(out, Assign)[3].rank == 1
    h.msg(3, Stopped(for_generation=4, committed_step=-1, valid=False))
    survivors_report(h, 4, 5)
    assert h.sent(h.advance(0.01), Recover), "no-progress limit restarts with the fresh process"
    for wid in (0, 2, 3):
        h.msg(wid, Recovered(generation=4))
    raised(h, 3, 5, 5)
    stop = stop_of(h)
    assert stop is not None and "again in a fresh process" in stop.why
    assert "retried in process 3 times and once in a fresh process" in stop.why


def test_a_respawn_names_the_step_of_a_raise_reported_only_to_a_round() -> None:
    """Rank 1 raised at step 2 on its own (a fault record), later at step 7 only in its report to
    the round rank 0's raise began: the worker's own limit, reached there, is step 7's, and the
    ``respawn`` event says so (it named step 2, the history's last record of rank 1)."""
    h = Harness()
    start_job(h)
    raised(h, 1, 1, 2)
    survivors_report(h, 1, 2)
    assert h.sent(h.advance(0.01), Recover)
    for wid in (0, 1, 2):
        h.msg(wid, Recovered(generation=1))
    raised(h, 0, 2, 7)  # a round for rank 0's raise ...
    raised(h, 1, 2, 7)  # ... to which rank 1's raise at step 7 comes as its report
    survivors_report(h, 2, 7, wids=(2,))
    assert h.sent(h.advance(0.01), Recover)
    for wid in (0, 1, 2):
        h.msg(wid, Recovered(generation=2))
    h.msg(1, Fatal(error="step 7 raised ValueError 4 times in a row (bad row)", kind="retries"))
    assert stop_of(h) is None, stop_of(h)
    [ev] = h.events("respawn")
    assert (ev["ranks"], ev["step"]) == ([1], 7), ev


def test_with_fresh_process_retries_off_the_workers_limit_ends_the_job() -> None:
    h = Harness(fresh_process_retries=0)
    start_job(h)
    h.msg(1, Fatal(error="step 5 raised ValueError 4 times in a row", kind="retries"))
    stop = stop_of(h)
    assert stop is not None and "rank 1: step 5 raised ValueError 4 times in a row" in stop.why
    assert not h.events("respawn")


def test_a_config_error_still_ends_the_job_at_once() -> None:
    h = Harness()
    start_job(h)
    h.msg(1, Fatal(error="ConfigError: no", kind="config"))
    stop = stop_of(h)
    assert stop is not None and "configuration error" in stop.why and not h.events("respawn")


def every_rank_raises(h: Harness, gen: int, snapshot: int | None) -> None:
    for wid in range(3):
        h.msg(
            wid,
            Stopped(
                for_generation=gen,
                committed_step=5,
                valid=True,
                cause="exception",
                error="ValueError: x",
                step=5,
                snapshot_step=snapshot,
            ),
        )
    h.advance(0.01)


@pytest.mark.parametrize("snapshot", [None, 4])
def test_every_rank_raising_is_respawned_only_onto_a_snapshot_or_checkpoint(snapshot: int | None) -> None:
    h = Harness(spares=0, max_repeat_faults=1)
    start_job_without_spares(h)
    every_rank_raises(h, 1, snapshot)
    for wid in range(3):
        h.msg(wid, Recovered(generation=1))
    every_rank_raises(h, 2, snapshot)  # the same exception a second time: the budget (1) is spent
    stop = stop_of(h)
    if snapshot is None:
        assert stop is not None and "Fresh processes for rank(s) [0, 1, 2] were not tried" in stop.why
        assert "ValueError: x" in stop.why
        return
    assert stop is None, stop
    assert h.events("respawn")[0]["ranks"] == [0, 1, 2]
    spawned = [c.worker_id for c in h.log if type(c).__name__ == "Spawn" and c.role == "spare"]
    assert len(spawned) == 3, "a fresh process for each rank (the job has no spare)"
    for wid in spawned:
        h.connect(wid)
        h.msg(wid, SpareReady())
    out = h.advance(0.01)
    assert sorted(a.rank for a in h.sent(out, Assign).values()) == [0, 1, 2]
    for wid in spawned:
        h.msg(wid, Stopped(for_generation=2, committed_step=-1, valid=False, snapshot_step=4))
    plans = h.sent(h.advance(0.01), Recover)
    assert plans and all(p.plan.from_snapshot and p.plan.target_step == 4 for p in plans.values())


def _two_ranks_three_retries(h: Harness) -> None:
    """A job of two ranks and no spare whose rank 1 raised at step 3 in generations 1-3."""
    for wid in (0, 1):
        h.connect(wid)
    h.form_generation(0, {0: 0, 1: 1}, committed=0)
    for gen in (1, 2, 3):
        raised(h, 1, gen, 3)
        survivors_report(h, gen, 3, wids=(0,))
        h.advance(0.01)
        for wid in (0, 1):
            h.msg(wid, Recovered(generation=gen))


@pytest.mark.parametrize("raise_first", [True, False])
def test_the_last_raise_and_the_workers_own_limit_give_the_rank_one_fresh_process(raise_first: bool) -> None:
    """The worker's 4th raise (its report to the round) and its own limit (``Fatal``, then its exit)
    race. Either order is one episode: one fresh process, which tries the step before anything
    replaces it. The raise held the budget's verdict for the round's plan, and that plan replaced
    the fresh process again before it tried (seen in CI: a second spare started, the first killed)."""
    h = Harness(nproc=2, spares=0)
    _two_ranks_three_retries(h)
    fatal = Fatal(error="step 3 raised ValueError 4 times in a row (bad row)", kind="retries", tries=4)
    if raise_first:
        raised(h, 1, 4, 3)
        h.msg(1, fatal)
    else:
        h.msg(1, fatal)
        raised(h, 1, 4, 3)
    h.exit(1, 1, own=True, detail="exited with code 1")
    h.closed(1)
    h.advance(0.01)
    spares = [c.worker_id for c in h.log if isinstance(c, Spawn) and c.role == "spare"]
    assert spares == [2], spares
    h.connect(2)
    h.msg(2, SpareReady())
    assert h.sent(h.advance(0.01), Assign)[2].rank == 1
    h.msg(2, Stopped(for_generation=4, committed_step=-1, valid=False))
    survivors_report(h, 4, 3, wids=(0,))
    out = h.advance(0.01)
    plans = h.sent(out, Recover)
    assert set(plans) == {0, 2} and plans[2].plan.receivers == [1], out
    assert [c.role for c in h.log if isinstance(c, Spawn)].count("spare") == 1, "one fresh process"
    assert not [c for c in h.log if isinstance(c, Kill) and c.worker_id == 2], "the fresh one lives"
    assert [(e["ranks"], e["retries"]) for e in h.events("respawn")] == [([1], 3)], h.events("respawn")
    for wid in (0, 2):
        h.msg(wid, Recovered(generation=4))
    raised(h, 2, 5, 3)  # the script's bug: the fresh process raises too
    stop = stop_of(h)
    assert stop is not None and "rank 1 raised at step 3 again in a fresh process" in stop.why


def test_an_injected_fault_is_acknowledged_and_a_replacement_never_fires_it_again() -> None:
    """The coordinator answers ``Fired`` with ``FiredSeen`` (a fault that ends its process waits
    for it), and the spare that takes the rank is told that the fault fired."""
    h = Harness()
    start_job(h)
    out = h.msg(1, Fired(id="kill:rank=1:step=3", kind="kill", time=1e9, step=3))
    assert h.sent(out, FiredSeen)[1].id == "kill:rank=1:step=3"
    h.exit(1, -9)
    assign = h.sent(h.advance(0.01), Assign)[3]
    assert assign.rank == 1 and "kill:rank=1:step=3" in assign.fired, assign


def test_the_retries_count_the_raises_a_round_heard_only_in_reports() -> None:
    """Rank 1 raises at step 7 in rounds that rank 0's raises began: none of its raises is a fault
    record, yet each was a try in its process. Its worker's limit (no count in its Fatal, as an
    older worker sends it) says 4; the respawn counts the 3 the rounds heard and the last one."""
    h = Harness()
    start_job(h)
    for gen in (1, 2, 3):
        raised(h, 0, gen, 7)  # the round's own fault ...
        raised(h, 1, gen, 7)  # ... and rank 1's raise, heard only as its report
        survivors_report(h, gen, 7, wids=(2,))
        assert h.sent(h.advance(0.01), Recover)
        for wid in (0, 1, 2):
            h.msg(wid, Recovered(generation=gen))
    h.msg(1, Fatal(error="step 7 raised ValueError 4 times in a row (bad row)", kind="retries"))
    assert [(e["ranks"], e["step"], e["retries"]) for e in h.events("respawn")] == [([1], 7, 3)]
