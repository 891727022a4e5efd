"""The step a fault event names, as a pure function of what the coordinator heard.

A rank that reports its own fault (an exception: its ``Stopped``) says the step it was running.
One that dies cannot; its heartbeat's step lags by up to a beat (a quarter second, read by the
agent on its own beat: 4 to 14 fast steps, measured), so a rehearsed fault says its step as it
fires (``Fired.step``), just before it kills or stops its process. Unit-tested in
tests/unit/coordinator/test_fatal_rules.py.
"""

from __future__ import annotations

__all__ = ["fault_step"]


def fault_step(reported: int | None, announced: int | None, heartbeat: int | None) -> int | None:
    """The fault's step: the rank's own report, else the step its injected fault fired at, else
    its last heartbeat's. An announcement older than the heartbeat (a ``slow`` fault the rank
    lived through, then another fault later) is stale: the heartbeat is newer then."""
    if reported is not None:
        return reported
    if announced is not None and (heartbeat is None or announced >= heartbeat):
        return announced
    return heartbeat
