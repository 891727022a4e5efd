"""A send or receive that the caller marks ``futureless`` (gloo's have no future) is not asked for
one: c10d's refusal is an exception that costs about 120 µs of CPU, and a pipeline stage sends
or receives at every microbatch. Its wait is still a pooled thread's, which an abort ends at
once."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from checkpointless.comm.handle import Handle
from checkpointless.errors import CommAborted

pytestmark = pytest.mark.timeout(30)


class _Work:
    """A gloo work as the handle sees it: bounded waits raise when their time runs out, as
    c10d's do; ``end()`` completes it."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self.bounded = 0  # bounded waits made (each one that runs out raises)
        self.futures = 0  # times get_future() was asked

    def end(self) -> None:
        self._ended.set()

    def get_future(self) -> object:
        self.futures += 1
        return object()

    def is_completed(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            self._ended.wait()
            return True
        self.bounded += 1
        if not self._ended.wait(timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        return True


def test_a_futureless_work_is_not_asked_for_a_future() -> None:
    work = _Work()
    h = Handle(work, "sent", lambda h: None, poll=True, futureless=True)
    threading.Timer(0.1, work.end).start()
    assert h.wait() == "sent"
    assert work.futures == 0 and work.bounded == 0  # waited on a pooled thread, never polled


def test_an_abort_wakes_the_wait_of_a_futureless_work_at_once() -> None:
    work = _Work()  # never completes until the end of the test: a peer that hangs
    h = Handle(work, None, lambda h: None, poll=True, futureless=True)
    threading.Timer(0.2, lambda: h.abort("a peer failed")).start()
    t0 = time.monotonic()
    with pytest.raises(CommAborted, match="a peer failed"):
        h.wait()
    assert time.monotonic() - t0 < 0.5 and work.futures == 0
    work.end()  # frees the pooled thread that waits on it
