"""Endings no spare can change, and the step a fault event names (issue 38, the frictions): the
pure rules (coordinator/rules/fatal.py, rules/fault_step.py), then the coordinator applying them
as the state machine it is."""

from __future__ import annotations

import pytest

from checkpointless.coordinator import Spawn, Stop
from checkpointless.coordinator.rules.fatal import (
    config_error_verdict,
    exit_verdict,
    unadopted_exit_verdict,
)
from checkpointless.coordinator.rules.fault_step import fault_step
from checkpointless.errors import CONFIG_ERROR_EXIT
from checkpointless.protocol import Assign, Fatal, Fired, Shutdown, Stopped
from tests.unit.coordinator.test_coordinator import Harness, start_job

pytestmark = pytest.mark.timeout(10)

TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 3\nConfigError: no such setting'


# -- the pure rules ---------------------------------------------------------------------------
def test_a_config_error_verdict_names_the_rank_first_and_the_error_once() -> None:
    why = config_error_verdict("rank 1", TRACEBACK)
    head, _, body = why.partition("\n")
    assert head.startswith("rank 1 stopped the job with a configuration error")
    assert "no spare or restart" in head and "no such setting" not in head  # logged by every process
    assert body == TRACEBACK and why.count("no such setting") == 1
    assert "traceback is above" in config_error_verdict("rank 0", "")


def test_exit_verdicts() -> None:
    script = "train.py"
    assert exit_verdict("rank 0", CONFIG_ERROR_EXIT, True, False, script) == config_error_verdict(
        "rank 0", ""
    )
    assert exit_verdict("spare 3", 0, False, False, script) == unadopted_exit_verdict("spare 3", script)
    unadopted = unadopted_exit_verdict("rank 0", script)
    assert "checkpointless.init()" in unadopted and "--plain" in unadopted and "docs/adoption.md" in unadopted
    # ordinary faults, for the spares and the fault budget
    assert exit_verdict("rank 0", 0, True, False, script) is None  # adopted, left its loop early
    assert exit_verdict("rank 0", 1, False, False, script) is None  # died before init(): a start failure
    assert exit_verdict("rank 0", -9, False, False, script) is None
    # one the coordinator killed (a hang, a retired spare) says nothing about the script
    assert exit_verdict("rank 0", CONFIG_ERROR_EXIT, True, True, script) is None
    assert exit_verdict("rank 0", 0, False, True, script) is None


@pytest.mark.parametrize(
    ("reported", "announced", "heartbeat", "want"),
    [
        (31, 30, 25, 31),  # its own report wins
        (None, 30, 25, 30),  # an injected fault said its step; the heartbeat lags
        (None, 30, None, 30),
        (None, None, 25, 25),  # a real kill: the last heartbeat is all there is
        (None, 10, 45, 45),  # a slow fault it lived through long ago: stale
        (None, None, None, None),
    ],
)
def test_fault_step(
    reported: int | None, announced: int | None, heartbeat: int | None, want: int | None
) -> None:
    assert fault_step(reported, announced, heartbeat) == want


# -- the coordinator applying them ------------------------------------------------------------
def test_a_config_error_ends_the_job_at_once_without_a_spare() -> None:
    h = Harness(spares=1)
    start_job(h)
    out = h.msg(1, Fatal(error=TRACEBACK, kind="config"))
    h.exit(1, CONFIG_ERROR_EXIT, own=True, detail=f"exited with code {CONFIG_ERROR_EXIT}")
    out += h.closed(1)
    stop = [c for c in out if isinstance(c, Stop)]
    assert stop and stop[0].code == 1 and stop[0].why == config_error_verdict("rank 1", TRACEBACK)
    assert not h.events("fault") and not h.sent(out, Assign), "no round, no spare given the rank"
    # every process is told to stop with the first line only: the traceback is printed once
    reasons = {s.reason for s in h.sent(out, Shutdown).values()}
    assert reasons == {stop[0].why.partition("\n")[0]}
    assert h.events("job_end")[0]["error"] == stop[0].why


def test_an_exit_with_the_config_error_status_ends_the_job_though_its_report_was_lost() -> None:
    h = Harness(spares=1)
    start_job(h)
    out = h.exit(2, CONFIG_ERROR_EXIT, own=True, detail=f"exited with code {CONFIG_ERROR_EXIT}")
    out += h.closed(2)
    stop = [c for c in out if isinstance(c, Stop)]
    assert stop and "rank 2 stopped the job with a configuration error" in stop[0].why
    assert not h.events("fault") and not h.sent(out, Assign)


def test_a_worker_that_exits_cleanly_without_init_ends_the_job_with_the_fix() -> None:
    h = Harness(spares=1)  # nobody connects: the script never calls checkpointless.init()
    out = h.exit(0, 0, own=False, detail="exited with code 0")
    stop = [c for c in out if isinstance(c, Stop)]
    assert stop and stop[0].code == 1, out
    assert stop[0].why.startswith("rank 0 exited with code 0 without ever calling checkpointless.init()")
    assert "--plain" in stop[0].why and not h.events("fault")
    assert not [c for c in out if isinstance(c, Spawn)], "no replacement is started"


def test_a_connected_worker_that_exits_cleanly_early_is_still_a_fault() -> None:
    h = Harness(spares=1)
    start_job(h)
    h.exit(0, 0, detail="exited with code 0")
    out = h.closed(0)
    assert [f["rank"] for f in h.events("fault")] == [0]
    assert not [c for c in out if isinstance(c, Stop)]


def test_a_killed_rank_s_fault_names_the_step_its_injected_fault_fired_at() -> None:
    h = Harness(spares=1)
    start_job(h)
    h.c.procs[1].step = 24  # its last heartbeat, a quarter second behind
    h.msg(1, Fired(id="kill:rank=1:step=30:site=step", kind="kill", time=1e9, step=30))
    h.exit(1, -9)
    faults = h.events("fault")
    assert [(f["rank"], f["kind"], f["step"]) for f in faults] == [(1, "killed", 30)]


def test_an_exception_s_fault_names_the_step_the_rank_reported() -> None:
    h = Harness(spares=1)
    start_job(h)
    h.c.procs[1].step = 24
    h.msg(1, Fired(id="raise:rank=1:step=30:site=step", kind="raise", time=1e9, step=30))
    h.msg(
        1, Stopped(for_generation=1, committed_step=30, valid=True, cause="exception", error="boom", step=30)
    )
    assert [(f["rank"], f["kind"], f["step"]) for f in h.events("fault")] == [(1, "exception", 30)]
    assert h.c.procs[1].announced_step is None, "spent: a later kill is judged by its heartbeats"
