"""A collective's completion as c10d code expects it (a ``dist.Work``), abortable.

What :class:`~checkpointless.comm.process_group.ResilientProcessGroup` returns for every
collective: ``wait()`` polls the group's :class:`~checkpointless.comm.communicator.Handle`, so an
abort from another thread wakes the waiter with :class:`~checkpointless.errors.CommAborted`.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, overload

import torch
import torch.distributed as dist

from checkpointless.comm.handle import Handle
from checkpointless.errors import CommAborted

__all__ = ["MAX_TIMEOUT", "AbortableWork", "ChainWork", "clamp_timeout", "in_flight", "waiting_since"]

# The longest wait that every wait below accepts: poll() takes a C int of milliseconds (about
# 24.8 days), and frameworks ask for more (Lightning's prepare_data group: 10000 days).
MAX_TIMEOUT = datetime.timedelta(milliseconds=2**31 - 1)


@overload
def clamp_timeout(timeout: datetime.timedelta) -> datetime.timedelta: ...
@overload
def clamp_timeout(timeout: None) -> None: ...
def clamp_timeout(timeout: datetime.timedelta | None) -> datetime.timedelta | None:
    """``timeout`` cut to :data:`MAX_TIMEOUT` (None stays None; a negative one becomes zero)."""
    if timeout is None:
        return None
    return max(datetime.timedelta(0), min(timeout, MAX_TIMEOUT))


# When this process began waiting on one of these groups' collectives (None: not waiting). Read
# by the worker's heartbeat so the launcher's hang triage sees a rank blocked in an FSDP
# collective as a victim, not a culprit. Per process, not per group: the main thread waits on
# one collective at a time.
_waiting_since: float | None = None
# The futures handed out and not yet completed (DDP's buckets in flight), each with the time it
# was asked for. DDP's reducer waits for them in C++ at the end of backward, where no wait() of
# ours runs, so they count as waiting: a rank blocked there for a peer that never sent its
# bucket must read as a victim too. One pending while backward still computes is harmless to
# the triage: it is pending only while a peer has not issued that bucket, i.e. while a peer, not
# this rank, is behind.
_deferred: dict[int, float] = {}
_deferred_lock = threading.Lock()


def in_flight() -> int:
    """How many futures :meth:`AbortableWork.get_future` handed out have not completed yet."""
    return len(_deferred)


def waiting_since() -> float | None:
    """``time.monotonic()`` when this process began waiting in a group collective, or None."""
    if _waiting_since is not None or not _deferred:
        return _waiting_since
    with _deferred_lock:
        return min(_deferred.values(), default=None)


class AbortableWork(dist.Work):
    """A collective's completion as c10d code expects it (a ``dist.Work``), abortable.

    ``wait()`` raises :class:`CommAborted` when the group is aborted while it waits; FSDP2
    calls it from its copy-out after an all-gather and from ``dist.*`` with ``async_op=False``.
    """

    # False: every get_future() waits for its collective first (no overlap of DDP's all-reduces
    # with backward), as until session 36; benchmarks/ddp_overlap.py measures both ways
    defer_futures: ClassVar[bool] = True

    def __init__(self, handle: Handle, result: Any, then: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._handle = handle
        self._result = result
        self._source: Any = None  # the gloo work of a receive from any source
        # run once, by the first wait() that sees the collective succeed, before it returns (a
        # reduce-scatter carried by an all-reduce copies its own part out: process_group.py)
        self._then = then
        self._then_lock = threading.Lock() if then is not None else None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # type: ignore[override]
        global _waiting_since
        timeout = clamp_timeout(timeout)
        secs = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        _waiting_since = time.monotonic()
        try:
            self._handle.wait(secs)
        finally:
            _waiting_since = None
        if self._then_lock is not None:
            with self._then_lock:
                then, self._then = self._then, None
                if then is not None:
                    then()
        return True

    def is_completed(self) -> bool:
        return self._handle.done() and self._then is None

    def is_success(self) -> bool:
        return self._handle.done() and self._handle.error is None

    def result(self) -> Any:
        return self._result

    @property
    def handle(self) -> Handle:
        """The completion this work waits on."""
        return self._handle

    def set_source(self, work: Any) -> None:
        """The backend's work of a receive from any source, which knows who sent (after the wait)."""
        self._source = work

    def _source_rank(self) -> int:
        if self._source is None:
            raise RuntimeError("only a receive from any source has a source rank")
        return int(self._source._source_rank())

    def get_future(self) -> torch.futures.Future[Any]:
        """A future of the collective that completes when it does, or fails when it fails or is
        aborted, without waiting here. DDP's reducer asks for it in the backward hook that
        issued a bucket's all-reduce and waits for every bucket's at the end of backward, so
        the all-reduces overlap the rest of backward as on a plain gloo group
        (``benchmarks/ddp_overlap.py``). A failure fails the future in C++ as well (see
        :meth:`_waited_future`): the reducer raises it out of ``backward()``."""
        if not AbortableWork.defer_futures or self._then is not None:
            return self._waited_future()
        handle = self._handle
        settled: torch.futures.Future[None] = torch.futures.Future()
        key = id(settled)

        def outcome(_: Any) -> Any:
            failure = handle.failure()
            if failure is not None:
                raise failure  # the chained future's error, in C++ too
            return self._result

        def finished(_: Handle) -> None:
            with _deferred_lock:
                _deferred.pop(key, None)
            settled.set_result(None)

        fut = settled.then(outcome)
        with _deferred_lock:
            _deferred[key] = time.monotonic()
        if handle.on_done(finished):
            return fut
        with _deferred_lock:  # a device (NCCL) collective: waited here, ordered on this stream
            _deferred.pop(key, None)
        return self._waited_future()

    def _waited_future(self) -> torch.futures.Future[Any]:
        """The future, completed by waiting here first (what :meth:`get_future` did for every
        collective until session 36)."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        try:
            self.wait()
        except CommAborted as e:
            error = e
        else:
            fut.set_result(self._result)
            return fut

        # Not fut.set_exception(): torch's Python Future keeps the exception as the future's
        # *value*, raised by its Python wait() only, so a C++ caller sees a success whose value is
        # no tensor (DDP's reducer then crashed with SIGSEGV reading its bucket). An error raised
        # in a then() callback is the future's error in C++ too; it reaches Python as a
        # RuntimeError naming CommAborted (recovery/process.py knows it).
        def fail(_: Any) -> None:
            raise error

        failed = fut.then(fail)
        fut.set_result(None)
        return failed


class ChainWork(AbortableWork):
    """Several works issued one after another on one group, waited on in order (an error in
    any of them is not lost)."""

    def __init__(self, works: list[AbortableWork], result: Any) -> None:
        super().__init__(works[-1].handle, result)
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # type: ignore[override]
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future[Any]:
        return self._waited_future()  # one future for several handles: waited here
