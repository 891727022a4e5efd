"""The launcher's give-up rules are pure functions: situations in, verdicts out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from checkpointless.coordinator.rules.budget import (
    FaultRecord,
    budget_verdict,
    progress_limit,
    start_failure_verdict,
)
from checkpointless.launcher.policy import (
    LOOP_BUSY_S,
    LOOP_QUIET_S,
    QUIET_AFTER_S,
    Limits,
    ProcWatch,
    loop_wait,
    signal_ends_the_job,
)
from checkpointless.launcher.proctable import ProcSample, parse_stat, read_sample

pytestmark = pytest.mark.timeout(20)

LIMITS = Limits(hang_timeout=5.0, start_timeout=60.0, stop_grace=0.5)


def sample(state: str = "S", cpu: float = 1.0) -> ProcSample:
    return ProcSample(pid=1, state=state, cpu_s=cpu)


def test_parse_stat_survives_a_command_name_with_spaces_and_parentheses() -> None:
    fields = " ".join(["T", *["0"] * 10, "250", "150", *["0"] * 30])
    s = parse_stat(42, f"42 (py (worker) 1) {fields}")
    assert (
        s is not None
        and s.state == "T"
        and s.stopped
        and s.cpu_s == pytest.approx(400 / os.sysconf("SC_CLK_TCK"))
    )
    assert parse_stat(42, "garbage") is None
    assert parse_stat(42, "42 (x) R 1 2") is None


def test_read_sample_sees_a_real_stop_and_continue() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while (s := read_sample(p.pid)) is not None and not s.stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s is not None and s.stopped
        os.kill(p.pid, signal.SIGCONT)
        time.sleep(0.05)
        s = read_sample(p.pid)
        assert s is not None and not s.stopped
    finally:
        p.kill()
        p.wait()
    assert read_sample(p.pid) is None  # reaped: no entry


def test_a_stopped_process_is_judged_after_the_grace_not_the_heartbeat_timeout() -> None:
    w = ProcWatch(spawned=0.0)
    w.observe(sample("T"), now=10.0)
    assert w.verdict(10.2, connected=True, limits=LIMITS) is None  # a stop and continue is no fault
    why = w.verdict(10.6, connected=True, limits=LIMITS)
    assert why is not None and "stopped" in why
    w.observe(sample("S"), now=10.7)  # continued in time
    assert w.verdict(10.8, connected=True, limits=LIMITS) is None


def test_a_starting_process_that_burns_cpu_is_left_alone_until_the_start_timeout() -> None:
    w = ProcWatch(spawned=0.0)
    for t in range(0, 59):
        w.observe(sample("R", cpu=float(t)), now=float(t))
        assert w.verdict(float(t), connected=False, limits=LIMITS) is None
    w.observe(sample("R", cpu=61.0), now=61.0)
    why = w.verdict(61.0, connected=False, limits=LIMITS)
    assert why is not None and "--start-timeout" in why
    assert "checkpointless.init()" in why and "--plain" in why  # an unadopted script never connects


def test_a_starting_process_without_cpu_progress_is_wedged() -> None:
    w = ProcWatch(spawned=0.0)
    w.observe(sample("S", cpu=2.0), now=1.0)
    w.observe(sample("S", cpu=2.0), now=5.0)
    assert w.verdict(5.0, connected=False, limits=LIMITS) is None
    w.observe(sample("S", cpu=2.0), now=6.5)
    why = w.verdict(6.5, connected=False, limits=LIMITS)
    assert why is not None and "no CPU progress" in why
    # once connected, CPU silence is the heartbeat's business, not this rule's
    assert w.verdict(6.5, connected=True, limits=LIMITS) is None


def test_progress_limit_follows_the_measured_step_time() -> None:
    assert progress_limit(10.0, 5.0, []) == 10.0
    assert progress_limit(10.0, 5.0, [0.5, 1.0]) == 10.0
    assert progress_limit(10.0, 5.0, [0.5, 4.0]) == 20.0


def test_budget_catches_the_same_rank_failing_at_every_later_step() -> None:
    history: list[FaultRecord] = []
    verdicts = []
    for step in range(11, 22):
        history.append(FaultRecord(1, "exception", step, f"RuntimeError: bad value at step {step}"))
        verdicts.append(budget_verdict(history, window=20, max_repeats=3))
    assert verdicts[:3] == [None, None, None]
    assert verdicts[3] is not None and "rank 1 failed 4 times with exception" in verdicts[3]
    assert "--max-repeat-faults" in verdicts[3]


def test_budget_catches_the_same_exception_moving_between_ranks() -> None:
    history = [FaultRecord(r, "exception", 10 + r, f"ValueError: nan loss at {r}") for r in range(4)]
    assert budget_verdict(history[:3], window=20, max_repeats=3) is None
    why = budget_verdict(history, window=20, max_repeats=3)
    assert why is not None and "same exception" in why and "[0, 1, 2, 3]" in why


def test_budget_forgives_faults_far_apart_and_symptoms() -> None:
    history = [FaultRecord(2, "killed", s, "terminated by SIGKILL") for s in (5, 40, 80, 120, 160)]
    assert budget_verdict(history, window=20, max_repeats=3) is None
    # survivors' failed collectives follow every real fault; they never use up a budget
    comm = [FaultRecord(0, "comm", s, "CommAborted") for s in range(10)]
    assert budget_verdict(comm, window=20, max_repeats=3) is None
    # different kinds on one rank are different faults
    mixed = [FaultRecord(1, k, 5, "x") for k in ("killed", "hang", "exit", "exception")]
    assert budget_verdict(mixed, window=20, max_repeats=3) is None


def test_start_failures_end_a_respawn_loop_with_the_cause() -> None:
    assert start_failure_verdict(3, 2, 3, "exited with code 1", "tail") is None
    why = start_failure_verdict(3, 3, 3, "exited with code 1: PermissionError: cache", "Traceback...")
    assert why is not None and "rank 3" in why and "PermissionError" in why and "Traceback" in why


def test_the_loop_slows_only_when_settled_and_quiet_for_a_while() -> None:
    assert LOOP_BUSY_S < LOOP_QUIET_S <= 0.1  # the process table is still read ten times a second
    assert loop_wait(100.0, 100.0 - QUIET_AFTER_S, settled=True) == LOOP_QUIET_S
    # anything in flight (a round, a process starting, an exit awaiting its connection's end)
    assert loop_wait(100.0, 0.0, settled=False) == LOOP_BUSY_S
    # an event moments ago: the rest of it (a killed rank's exit after its connection's end)
    assert loop_wait(100.0, 100.0 - QUIET_AFTER_S / 2, settled=True) == LOOP_BUSY_S


def test_a_signal_ends_the_job_unless_a_successor_has_taken_over() -> None:
    """The secret and the record go on SIGTERM unless a successor recorded itself: a coordinator
    that stepped down because scancel's SIGTERM reached the agents first (every host lost at once)
    still removes them when its own SIGTERM comes."""
    own, other = "10.0.0.1:29500", "10.0.0.2:29500"
    assert signal_ends_the_job(False, own, own)
    assert signal_ends_the_job(False, other, own)  # still the coordinator: its signal ends the job
    assert signal_ends_the_job(True, None, own)  # stepped down, nobody took over
    assert signal_ends_the_job(True, own, own)
    assert not signal_ends_the_job(True, other, own)  # the successor's job goes on
