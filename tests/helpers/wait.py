"""One way for a test to wait for something that another process or thread makes true.

Every wait has a deadline on the monotonic clock (a wall-clock jump must not cut a wait short or
stretch it), fails with a message that names what was awaited, and returns what the condition
returned, so a test waits for a value and uses it in one line. A test that shares one deadline
among several waits passes the same instant to each; one that waits a number of seconds passes
``deadline_in(seconds)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .zygote import Process

__all__ = ["deadline_in", "wait_for"]

T = TypeVar("T")


def deadline_in(seconds: float) -> float:
    """The monotonic instant ``seconds`` from now, as ``wait_for`` takes it."""
    return time.monotonic() + seconds


def wait_for(
    cond: Callable[[], T],
    deadline: float,
    what: str,
    *,
    interval: float = 0.05,
    proc: Process | None = None,
    details: Callable[[], object] | None = None,
) -> T:
    """Poll ``cond()`` every ``interval`` s until it returns something truthy, and return that.

    Fails with an AssertionError naming ``what`` once ``deadline`` (a ``time.monotonic()``
    instant) has passed, or, when ``proc`` is given, as soon as that process has ended first
    (what it was to produce will not come). ``details()`` is added to either message: the state
    that explains the failure, read only when there is one.
    """
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                _message(f"the process ended (exit code {proc.returncode}) before {what}", details)
            )
        if time.monotonic() >= deadline:
            raise AssertionError(_message(f"timed out waiting for {what}", details))
        time.sleep(interval)


def _message(head: str, details: Callable[[], object] | None) -> str:
    return head if details is None else f"{head}:\n{details()}"
