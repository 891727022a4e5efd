"""How a handle waits, without a process group (a stand-in work that behaves as gloo's).

A send or receive that the caller marks ``futureless`` (gloo's have no future) is not asked for
one: c10d's refusal is an exception that costs about 120 µs of CPU, and a pipeline stage sends
or receives at every microbatch. Its wait is still a pooled thread's, which an abort ends at
once.

A gloo collective's wait makes one bounded wait inside gloo, then sleeps until the work's
future or an abort wakes it: each bounded wait that runs out is a c10d exception (~120-180 µs
of CPU), and a stage waiting for a slower one used to pay one per 10 ms."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import pytest
import torch

from checkpointless.comm.handle import Handle
from checkpointless.errors import CommAborted

pytestmark = pytest.mark.timeout(30)


class _Future(torch.futures.Future[None]):
    """A future that counts the callbacks added to it."""

    callbacks = 0

    def add_done_callback(self, callback: Callable[[torch.futures.Future[None]], None]) -> None:
        self.callbacks += 1
        super().add_done_callback(callback)


class _Work:
    """A gloo work as the handle sees it: bounded waits raise when their time runs out, as
    c10d's do; ``end()`` completes it."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self.future = _Future()
        self.bounded = 0  # bounded waits made (each one that runs out raises)
        self.futures = 0  # times get_future() was asked

    def end(self, error: Exception | None = None) -> None:
        # as gloo does: the future completes first (its callbacks run here, on the completing
        # thread), then the work counts as completed
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(error)
        self._ended.set()

    def get_future(self) -> _Future:
        self.futures += 1
        return self.future

    def is_completed(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            self._ended.wait()
        else:
            self.bounded += 1
            if not self._ended.wait(timeout.total_seconds()):
                raise RuntimeError("Operation timed out!")
        self.future.value()  # a failed work's wait raises its error, as c10d's does
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


def test_a_gloo_collective_that_completes_in_the_first_bounded_wait_adds_no_callback() -> None:
    work = _Work()
    work.end()
    h = Handle(work, "reduced", lambda h: None, poll=True)
    assert h.wait() == "reduced"
    assert work.bounded == 1 and work.future.callbacks == 0


def test_a_long_gloo_wait_makes_one_bounded_wait_then_sleeps_until_the_future_completes() -> None:
    work = _Work()
    finished: list[Handle] = []
    h = Handle(work, "reduced", finished.append, poll=True)
    threading.Timer(0.3, work.end).start()  # a peer 300 ms late: 30 bounded waits before
    assert h.wait() == "reduced"
    assert work.bounded == 1 and work.future.callbacks == 1
    assert finished == [h] and h.done() and h.error is None


def test_an_abort_wakes_a_long_gloo_wait_at_once_after_its_first_bounded_wait() -> None:
    work = _Work()  # a peer that hangs
    h = Handle(work, None, lambda h: None, poll=True)
    aborted: list[float] = []

    def abort() -> None:
        aborted.append(time.monotonic())
        h.abort("a peer failed")

    threading.Timer(0.2, abort).start()
    with pytest.raises(CommAborted, match="a peer failed"):
        h.wait()
    # woken by the abort's event, not by a bounded wait running out (those would be 10 ms apart)
    assert time.monotonic() - aborted[0] < 0.1
    assert work.bounded == 1
    work.end()  # the callback that fires now finds the handle finished and changes nothing
    assert isinstance(h.error, CommAborted)


def test_a_gloo_wait_keeps_its_deadline_and_a_later_wait_sees_the_completion() -> None:
    work = _Work()
    h = Handle(work, "reduced", lambda h: None, poll=True)
    t0 = time.monotonic()
    with pytest.raises(CommAborted, match="did not complete within"):
        h.wait(0.1)
    assert 0.1 <= time.monotonic() - t0 < 1.0 and not h.done()
    work.end()
    assert h.wait(1.0) == "reduced"
    assert work.bounded == 1 and work.future.callbacks == 1  # the second wait added none


def test_a_gloo_collective_that_fails_while_its_waiter_sleeps_raises_comm_aborted() -> None:
    work = _Work()
    h = Handle(work, None, lambda h: None, poll=True)
    threading.Timer(0.2, lambda: work.end(RuntimeError("Connection closed by peer"))).start()
    with pytest.raises(CommAborted, match=r"collective failed: .*Connection closed by peer"):
        h.wait()
