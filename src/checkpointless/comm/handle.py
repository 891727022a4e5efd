"""Completion of one collective that another thread can fail at once, and the groups it runs on.

Why not plain ``torch.distributed`` waits: gloo's ``abort()`` does not wake a thread that is
already waiting in a collective (measured on torch 2.13), and a hung peer keeps its sockets
open, so a waiting survivor would sit until gloo's timeout. Every collective's completion is
mirrored into a :class:`Handle` that we own; the group's ``abort()`` fails every pending handle,
and the waiting thread leaves within 10 ms (at once after its first 10 ms; see :class:`Handle`).
(An NCCL collective of CUDA tensors never holds the host: its handle completes as it is
enqueued, or at once when it was synchronous and NCCL returned no work.) Used by
:class:`~checkpointless.comm.process_group.ResilientProcessGroup`, on which every communicator of
a job is built.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from checkpointless.config import ENV
from checkpointless.errors import CommAborted, RendezvousError

__all__ = [
    "GLOO_CONNECT_CHOICES",
    "GLOO_CONNECT_VAR",
    "Handle",
    "completes",
    "default_backend",
    "gloo_connect",
    "new_group",
]


_FIRST_WAIT_S = 0.01  # a gloo wait's one bounded wait inside gloo; an abort is seen within it


class Handle:
    """Completion of one collective, abortable from another thread.

    How completion is observed, for a gloo collective (``poll``): the waiting thread first waits
    inside gloo for up to 10 ms (the GIL released), which is how most waits end, at plain
    torch's cost. A wait that runs past that (c10d raises, ~120-180 µs of CPU) adds a callback
    to the work's future and sleeps on the handle's event, which the callback or an abort sets.
    A wait thus costs at most one timeout and one callback however long it lasts; going on in
    10 ms bounded waits cost an exception per 10 ms, 1-2 ms of CPU a step for a pipeline stage
    that waits for the slower one (``benchmarks/wait_cost.py``). An abort is seen within the
    first 10 ms, and at once after them. The callback runs on gloo's own thread, so a long
    wait's wake-up costs no thread of ours: 0.1-0.4 ms later than the slices' at load 15, where
    handing long waits to a pooled thread had cost 1-2.5 ms (5-25 ms at the 90th percentile).
    The callback is added only once the waiter sleeps, never as the collective is issued: a
    callback that runs on gloo's thread while the training thread is busy must take the GIL
    from it, which stalled each bucket's all-reduce issue in the backward pass by about a
    millisecond on shared cores. And a callback costs ~150 µs of CPU itself (the GIL taken by a
    foreign thread, one more wake-up), which the first bounded wait saves on the short waits.
    Works without a future (gloo send/recv) are waited on a helper thread: their bounded wait
    fails the work when it runs out, and their ``is_completed()`` stays false until someone
    waits. NCCL works get a future callback as they are issued.
    """

    __slots__ = (
        "_done",
        "_error",
        "_listeners",
        "_lock",
        "_on_finish",
        "_poll",
        "_stream_work",
        "_watched",
        "_work",
        "result",
    )

    def __init__(
        self,
        work: Any,
        result: Any,
        on_finish: Callable[[Handle], None],
        poll: bool = False,
        futureless: bool = False,
    ) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._work = work
        # runs on the finishing thread, often gloo's own: it must not hold the group that owns
        # the backend, whose destructor joins that thread (GenerationGroup holds it weakly)
        self._on_finish = on_finish
        self._poll = False
        self._watched = False  # a gloo wait added its future callback (see _wait_gloo)
        self._listeners: list[Callable[[Handle], None]] | None = None  # see on_done
        # NCCL: the future completes once the collective is *enqueued* on NCCL's stream, and its
        # callback runs on a stream of its own. The waiting thread's stream must still be made
        # to wait for the collective's end, as work.wait() does (on the host it does not block),
        # or the next kernel on it could read the buffer before the reduction has written it.
        self._stream_work: Any = None
        self.result = result
        if work is None:
            # A synchronous NCCL collective (``async_op=False``: torch passes ``asyncOp`` False
            # and NCCL, from torch 2.8, issues it on the caller's stream and returns no work).
            # Kernels later on that stream already run after it, so to its caller it is done;
            # an abort still reaches it, through the group's NCCL abort of its kernels.
            self._done.set()
            return
        try:
            # ``futureless``: the caller knows the work has none (a gloo send or receive), so it
            # is not asked: c10d's refusal is an exception that costs about 120 µs of CPU, and a
            # pipeline stage sends or receives at every microbatch
            if futureless:
                raise RuntimeError("no future")
            fut = work.get_future()
        except RuntimeError:
            # gloo's send/recv (and its own reduce-scatter, which process_group.py therefore
            # issues as the all-reduce it is) have no future, and their wait ignores its
            # timeout, so they cannot be polled: a pooled thread waits for them instead
            _waiters().submit(self._wait_work)
        else:
            if poll:
                self._poll = True  # completion is seen by wait(), a callback added only by it
            else:
                self._stream_work = work
                fut.add_done_callback(self._on_future)

    def _wait_work(self) -> None:
        try:
            self._work.wait()
        except Exception as e:
            self._finish(e)
        else:
            self._finish(None)

    def _on_future(self, fut: Any) -> None:
        try:
            fut.value()
        except Exception as e:
            self._finish(e)
        else:
            self._finish(None)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            listeners, self._listeners = self._listeners, None
        self._work = None  # the gloo work may outlive us in the graveyard; drop our reference
        self._on_finish(self)
        for fn in listeners or ():
            fn(self)

    def on_done(self, fn: Callable[[Handle], None]) -> bool:
        """Call ``fn(self)`` once the collective has finished, failed or been aborted: at once
        if it has, else on the thread that finishes it (gloo's own, or the aborting one), so
        nobody has to wait for it. A gloo collective's future callback is added now, which a
        wait adds only once it sleeps (see the class): whoever asks this wants not to wait.

        Returns False, calling nothing, for a collective on a device stream (NCCL): its end must
        be ordered on the waiting thread's stream, which only :meth:`wait` does."""
        if self._stream_work is not None:
            return False
        with self._lock:
            pending = not self._done.is_set()
            if pending:
                self._listeners = [*(self._listeners or ()), fn]
        if not pending:
            fn(self)
            return True
        work = self._work  # None once finished (the listener then ran above or in _finish)
        if self._poll and work is not None and not self._watched:
            self._watched = True
            work.get_future().add_done_callback(self._on_future)
        return True

    def abort(self, reason: str) -> None:
        work = self._work
        if self._poll and work is not None and _completed(work):
            # It completed before the abort, but its waiter has not looked yet (on busy cores the
            # abort's thread can take the GIL before the waiter returns from gloo). Its outcome
            # stands: every rank's part is in, and a peer may already act on it. The barrier
            # before a sharded update depends on this (recovery/guard.py): had this rank failed a
            # barrier its peers passed, they would update and it would not, and the shard
            # groups would end at different steps with no single step's state anywhere
            # (Communicator.barrier).
            self._finish(_outcome(work))
            return
        self._finish(CommAborted(reason))

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """Why the collective failed (None while pending, and once it has succeeded)."""
        return self._error

    @property
    def work(self) -> Any:
        """The backend's work while the collective is pending (None once it has finished)."""
        return self._work

    def _wait_gloo(self, deadline: float | None) -> None:
        """Wait for a gloo collective until it finishes, is aborted, or ``deadline`` passes."""
        work = self._work  # _finish (an abort, from any thread) clears the attribute
        if work is None or self._done.is_set():
            return
        if not self._watched:
            left = _FIRST_WAIT_S if deadline is None else min(_FIRST_WAIT_S, deadline - time.monotonic())
            if left > 0:
                try:
                    # whole milliseconds, at least one: c10d reads a 0 ms timeout as "wait for ever"
                    work.wait(datetime.timedelta(milliseconds=max(1, int(left * 1000))))
                except Exception:
                    if work.is_completed():
                        # It may have completed between our bounded wait giving up and the
                        # check: the exception could be that timeout, not the collective's.
                        self._finish(_outcome(work))
                        return
                else:
                    self._finish(None)
                    return
            # Still pending: from here gloo's thread tells us (the callback runs inline if the
            # work completed since), and an abort sets the same event.
            self._watched = True
            work.get_future().add_done_callback(self._on_future)
        self._done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def failure(self) -> CommAborted | None:
        """What :meth:`wait` raises for this finished collective (None: it succeeded, or is
        still pending): the abort, or the backend's error as a :class:`CommAborted`."""
        error = self._error
        if error is None or isinstance(error, CommAborted):
            return error
        failed = CommAborted(f"collective failed: {error}")
        failed.__cause__ = error
        return failed

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for completion; raise :class:`CommAborted` if aborted or the collective failed."""
        if self._poll:
            self._wait_gloo(None if timeout is None else time.monotonic() + timeout)
        if not self._done.wait(0 if self._poll else timeout):
            raise CommAborted(f"collective did not complete within {timeout:.1f} s")
        failure = self.failure()
        if failure is not None:
            raise failure
        work, self._stream_work = self._stream_work, None
        if work is not None:
            try:
                work.wait()  # orders this thread's current stream after the collective
            except Exception as e:
                raise CommAborted(f"collective failed: {e}") from e
        return self.result


class _Waiters:
    """Daemon threads that wait for works, reused while idle. A wait stuck on a dead peer holds
    its thread until gloo's own timeout, so a new thread is started whenever none is idle. Not
    ``ThreadPoolExecutor``: its threads are joined at interpreter exit, and a stuck one would
    hold a finishing process for gloo's whole timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            else:
                threading.Thread(target=self._serve, daemon=True, name="cl-work-wait").start()
        self._jobs.put(fn)

    def _serve(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_pool: _Waiters | None = None


def _waiters() -> _Waiters:
    """The process's waiters, made on first use and again in a forked child (threads do not
    survive a fork; the fork template never waits on a collective)."""
    global _pool
    if _pool is None:
        _pool = _Waiters()
    return _pool


def _forget_pool() -> None:
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def completes(work: Any, within: float) -> bool:
    """Whether a polled (gloo) ``work`` whose handle was aborted still completes successfully
    within ``within`` seconds. Its group is parked, not destroyed, so the wait is safe."""
    if work is None:
        return False
    try:
        work.wait(datetime.timedelta(milliseconds=max(1, int(within * 1000))))
    except Exception:
        return False
    return True


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return False


def _outcome(work: Any) -> BaseException | None:
    """A completed work's own result: its exception, or None (no wait: it has completed)."""
    try:
        work.wait(datetime.timedelta(milliseconds=1))
    except Exception as e:
        return e
    return None


def default_backend() -> str:
    """gloo on CPU, NCCL when CUDA is present; ``CHECKPOINTLESS_BACKEND`` overrides."""
    choice = os.environ.get("CHECKPOINTLESS_BACKEND")
    if choice:
        return choice
    return "nccl" if torch.cuda.is_available() else "gloo"


GLOO_CONNECT_VAR = "CHECKPOINTLESS_GLOO_CONNECT"
GLOO_CONNECT_CHOICES = ("lazy", "full")


def gloo_connect() -> str:
    """How a gloo group of the launcher's connects its ranks: ``lazy`` (the default) or ``full``.

    ``lazy`` (gloo's lazy init) publishes each rank's key but reads a peer's key, and connects
    to it, only when a collective first needs that peer: a ring all-reduce its two neighbours, a
    tree broadcast or barrier about log2(N) more. ``full`` is gloo's full mesh: each rank reads
    every rank's key and connects to all N-1 peers before the group exists, at start-up and at
    every rebuild. Each generation is a new gloo device (a new listener port and new pair
    sequence numbers), so every key changes at every rebuild and none can be kept from the last
    generation; what lazy saves is reading, and connecting to, the peers no collective of the
    generation uses (docs/rendezvous.md, "What a rebuild reads").

    What lazy changes: the key reads move into the collective, where gloo calls the store from
    its own C++ worker thread, so a peer that died by then fails the collective that first needs
    it, not the forming. That failure must not be a Python exception: the work keeps it and
    throws it again at each wait, and pybind11 aborts the process (SIGABRT) the second time a
    Python error is thrown from one work. Session 34 met exactly this: the survivors of a kill
    died too, since a polled wait asks a completed work for its outcome again. The root-less
    store therefore fails a read on such a thread with a value torch's C++ refuses (a C++
    ``TypeError`` naming the reason, safe to throw again; rendezvous/foreign_reads.py), and the
    collective fails like any other. ``full`` stays selectable: it reads every key on the
    calling thread, so a dead peer fails the group's forming instead.
    """
    choice = os.environ.get(GLOO_CONNECT_VAR, "lazy")
    if choice not in GLOO_CONNECT_CHOICES:
        raise RendezvousError(
            f"{GLOO_CONNECT_VAR}={choice!r} is not a gloo connection mode; use 'lazy' (connect to a "
            "peer when a collective first needs it, the default) or 'full' (gloo's full mesh)"
        )
    return choice


def new_group(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if backend == "gloo":
        host = os.environ.get(ENV.HOST)
        if not host:  # standalone: gloo's own choice (the interface of this machine's host name)
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        # Under the launcher, gloo's listener binds to the job's interface (--host) only; its
        # default follows the host name, which may be reachable from other machines.
        gopts = dist.ProcessGroupGloo._Options()
        gopts._timeout = timeout
        lazy = gloo_connect() == "lazy"
        gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=lazy)]
        return dist.ProcessGroupGloo(store, rank, world_size, gopts)
    raise RendezvousError(f"unknown backend {backend!r}; use gloo or nccl (CHECKPOINTLESS_BACKEND)")
