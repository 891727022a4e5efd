"""The launcher's rules as pure functions: what it has observed in, a verdict out. No I/O here.

* :class:`ProcWatch` judges one process from the process table (stopped, wedged before it
  connected, too slow to start);
* :func:`loop_wait` paces the launcher's own loop: brisk while anything is in flight, slower
  while the job just trains.

The coordinator's own rules (the fault budget, the no-progress limits) are in
``coordinator/rules/budget.py``. Each is unit-tested by feeding it a situation (tests/unit/coordinator/test_policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointless.launcher.proctable import ProcSample
from checkpointless.settings import JobSettings

__all__ = [
    "LOOP_BUSY_S",
    "LOOP_QUIET_S",
    "QUIET_AFTER_S",
    "Limits",
    "ProcWatch",
    "loop_wait",
    "signal_ends_the_job",
]


@dataclass(frozen=True)
class Limits:
    """The settings these rules read (from the job's :class:`~checkpointless.settings.JobSettings`)."""

    hang_timeout: float  # heartbeat silence, and CPU silence before a process has connected
    start_timeout: float  # how long a process may take to connect at all
    stop_grace: float = 0.5  # a job-control stop must last this long before it counts

    @classmethod
    def of(cls, job: JobSettings) -> Limits:
        return cls(hang_timeout=job.hang_timeout, start_timeout=job.start_timeout)


class ProcWatch:
    """What the launcher remembers about one process between process-table readings."""

    __slots__ = ("cpu_changed", "last_cpu", "spawned", "stopped_since")

    def __init__(self, spawned: float) -> None:
        self.spawned = spawned
        self.last_cpu = -1.0
        self.cpu_changed = spawned
        self.stopped_since: float | None = None

    def observe(self, sample: ProcSample | None, now: float) -> None:
        if sample is None:
            return  # gone: the exit poll reports it with its real exit status
        if sample.cpu_s != self.last_cpu:
            self.last_cpu = sample.cpu_s
            self.cpu_changed = now
        if sample.stopped:
            if self.stopped_since is None:
                self.stopped_since = now
        else:
            self.stopped_since = None

    def verdict(self, now: float, connected: bool, limits: Limits) -> str | None:
        """Why this process must be killed and replaced, or None while it is fine.

        A stopped process is judged from the process table at once (after a short grace, so that
        a stop and an immediate continue is not a fault). Before it has connected, a process is
        importing and building its model: as long as it burns CPU it is making progress, so only
        CPU silence for the hang timeout (a deadlock, a wait on something that never comes) or
        the start-up limit as a whole ends it.
        """
        if self.stopped_since is not None and now - self.stopped_since >= limits.stop_grace:
            return f"stopped (process state T for {now - self.stopped_since:.1f} s)"
        if connected:
            return None
        if now - self.cpu_changed > limits.hang_timeout:
            return (
                f"made no CPU progress for {now - self.cpu_changed:.1f} s before connecting "
                f"(wedged while starting; --hang-timeout {limits.hang_timeout:g} s)"
            )
        if now - self.spawned > limits.start_timeout:
            # a script that never calls checkpointless.init() never connects (issue 38)
            return (
                f"did not connect within --start-timeout {limits.start_timeout:g} s (a script that "
                "does not call checkpointless.init() never does: run it with --plain)"
            )
        return None


# The launcher's loop waits this long for a message before it looks at its processes again.
# Busy: a round in flight, a process starting or exiting, anything but heartbeats lately. Then an
# exit seen by waitpid a tick late is a tick more downtime. Quiet: the job trains, every message
# (a worker's report, a connection's end) wakes the loop at once anyway, and the process table is
# still read ten times a second; a 50 Hz loop there cost ~9 ms of CPU a second more, taken from
# training ranks that use every core (benchmarks/supervision_cpu.py on 2 cores: 15.2 -> 6.0 ms/s).
LOOP_BUSY_S = 0.02
LOOP_QUIET_S = 0.1
QUIET_AFTER_S = 2.0  # ... and the loop stays brisk this long after the last event


def loop_wait(now: float, last_event: float, settled: bool) -> float:
    """Seconds the launcher's loop may wait for a message: ``settled`` (the coordinator has
    nothing in flight) and no event since ``QUIET_AFTER_S`` before ``now``, or it keeps ticking."""
    if settled and now - last_event >= QUIET_AFTER_S:
        return LOOP_QUIET_S
    return LOOP_BUSY_S


def signal_ends_the_job(stepped_down: bool, recorded: str | None, own: str) -> bool:
    """Whether a SIGTERM or SIGINT to this coordinator ends the job, so its secret and its record
    go at once (before a scheduler's SIGKILL: scancel's KillWait can be 2 s).

    A coordinator that stepped down leaves both to its successor, but only once a successor has
    recorded itself (``recorded`` names another address). Under ``scancel`` the agents often get
    their SIGTERM first: their connections close, every host is lost at once, the coordinator
    steps down for want of a majority, and its own SIGTERM comes a moment later. With no
    successor recorded there is no job left to keep the secret for."""
    return not stepped_down or recorded is None or recorded == own
