"""A process group's generations: the communicators it forms for each one, the abort that ends
one, and the issuing of a single collective on the current one.

:class:`GenerationGroup` is the base of
:class:`~checkpointless.comm.process_group.ResilientProcessGroup`: a group of fixed members whose
gloo group (and, on a CUDA host, NCCL group) is formed anew by :meth:`~GenerationGroup.configure`
for each generation, failed at once by :meth:`~GenerationGroup.abort` from any thread, and parked
rather than destroyed under a waiting thread. It is kept apart from the subclass, which is what
c10d, FSDP2 and DTensor see (its identity and every collective, each one a call of
:meth:`~GenerationGroup.handle`), so that the locking, the pending handles and the parked groups
are read in one place.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from checkpointless.comm.handle import Handle, new_group
from checkpointless.errors import CommAborted, RendezvousError

__all__ = ["GenerationGroup", "on_cuda"]


class GenerationGroup(dist.ProcessGroup):
    """The generations of one group of fixed members (global ranks); see the subclass
    :class:`~checkpointless.comm.process_group.ResilientProcessGroup`, the one that is made."""

    def __init__(
        self,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        timeout: datetime.timedelta,
        key: str | None = None,
        device_backend: str | None = None,
    ):
        super().__init__(rank, size)
        if not 0 <= rank < size or len(global_ranks) != size:
            raise ValueError(
                f"ResilientProcessGroup: rank {rank} and members {list(global_ranks)} do not fit "
                f"a group of size {size}; pass the group rank and all {size} global ranks"
            )
        self._group_rank = rank
        self._group_size = size
        self.global_ranks = tuple(global_ranks)
        # the default group needs a key of its own: a 1-D mesh's group has the same members
        self.key = key or "r" + ".".join(str(r) for r in self.global_ranks)
        self.timeout = timeout
        # "nccl": each generation also forms a group for CUDA tensors (None: gloo carries all)
        self.device_backend = device_backend
        self.generation = -1
        # re-entrant: a collective that fails at once completes its Handle inside _issue, and
        # the completion callback takes this lock again to forget the handle
        self._lock = threading.RLock()
        self._pg: Any = None
        self._dev_pg: Any = None  # this generation's group for CUDA tensors (device_backend)
        self._pending: set[Handle] = set()
        self._aborted: str | None = "not configured yet"
        self._graveyard: list[Any] = []
        self._stores: list[Any] = []  # the current generation's stores (see configure)
        self._name: str | None = None
        self._desc = self.key
        # called with "allreduce" or "reduce_scatter" before such a collective is issued, and
        # with "send" or "recv" before a point-to-point op: the job's fault-injection sites (an
        # exception raised here surfaces inside FSDP's backward, or a pipeline stage's send)
        self.before_collective: Callable[[str], None] | None = None
        # What each handle calls as it finishes, holding this group weakly. The finishing thread
        # is gloo's own: were a handle to hold the group, a collective whose caller has let go of
        # the group (a DDP job returning from its step) would drop its last reference there, and
        # ~ProcessGroupGloo would join that very thread ("Resource deadlock avoided", abort).
        self._forget_weakly = functools.partial(_call_if_alive, weakref.WeakMethod(self._forget))

    def configure(
        self,
        generation: int,
        store: dist.Store,
        deadline: float,
        cancelled: threading.Event | None = None,
        backend: str = "gloo",
    ) -> None:
        """Form this group's communicator of ``generation`` from ``store`` (a prefix store of
        that generation) and make it current. Blocks until every member has joined, the
        ``deadline`` (``time.monotonic()``) passes, or ``cancelled`` is set. Construction runs
        on a helper thread so that a cancel ends the wait even while gloo is connecting."""
        self.abort(f"superseded by generation {generation}")
        result: dict[str, Any] = {}
        sub = dist.PrefixStore(f"{self.key}/", store)

        dev_sub = dist.PrefixStore(f"{self.device_backend}/", sub) if self.device_backend else None
        # Every store gloo may call into, down to a Python one (the root-less store): the C++
        # side keeps only its C++ half. A cancelled or timed-out configure returns while gloo is
        # still connecting on the helper thread, and its callers then drop their references; the
        # thread holds these until gloo is done with them, and a formed generation keeps them.
        chain = _store_chain(dev_sub or sub)

        def build() -> None:
            assert chain  # referenced here, so this thread keeps the stores alive
            try:
                left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
                result["pg"] = new_group(backend, sub, self._group_rank, self._group_size, left)
                if self.device_backend and dev_sub is not None:
                    left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
                    result["dev"] = new_group(
                        self.device_backend, dev_sub, self._group_rank, self._group_size, left
                    )
            except Exception as e:
                result["error"] = e

        th = threading.Thread(target=build, daemon=True, name=f"cl-rpg-{self.key}-gen{generation}")
        th.start()
        while th.is_alive():
            th.join(0.005)
            if cancelled is not None and cancelled.is_set():
                raise RendezvousError(f"group {self.key} generation {generation}: cancelled by a newer fault")
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"group {self.key} generation {generation}: timed out; some member never joined"
                )
        if "error" in result:
            raise RendezvousError(f"group {self.key} generation {generation} failed: {result['error']}")
        with self._lock:
            for old in (self._pg, self._dev_pg):
                if old is not None:
                    self._graveyard.append(old)
            self._pg = result["pg"]
            self._dev_pg = result.get("dev")
            # a Python store must outlive its process group (torch keeps only the C++ half):
            # this generation's stay referenced here until the next one replaces them
            self._graveyard.extend(self._stores)
            self._stores = chain
            self.generation = generation
            self._aborted = None

    def abort(self, reason: str = "aborted") -> int:  # type: ignore[override]
        """Fail every pending collective now (thread-safe) and refuse new ones until the next
        :meth:`configure`; return how many were pending."""
        with self._lock:
            self._aborted = reason
            pending = list(self._pending)
            if self._pg is not None:
                self._graveyard.append(self._pg)  # parked: destroying it could block on gloo
                self._pg = None
            if self._dev_pg is not None:
                self._dev_pg.abort()  # NCCL can abort its kernels (a hung one holds the stream)
                self._graveyard.append(self._dev_pg)
                self._dev_pg = None
        for h in pending:
            h.abort(f"group {self.key} generation {self.generation} aborted: {reason}")
        return len(pending)

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def release_graveyard(self, here: bool = False) -> None:
        """Drop parked gloo groups. Their destructors join gloo's threads, so by default that
        happens on a helper thread; ``here`` does it on the calling thread (see :meth:`close`)."""
        with self._lock:
            parked, self._graveyard = self._graveyard, []
        if here:
            parked.clear()
        elif parked:
            threading.Thread(target=parked.clear, daemon=True, name="cl-rpg-reaper").start()

    def close(self) -> None:
        """Drop this group's communicators now, on the calling thread (a job without our launcher,
        at its exit: recovery/process.py's ``close_at_exit``). Pending collectives fail first."""
        self.abort("closed")
        # the gloo destructors join their threads here, while the interpreter is alive
        self.release_graveyard(here=True)
        with self._lock:
            stores, self._stores = self._stores, []
        stores.clear()

    def handle(self, fn: Callable[[Any], Any], result: Any, on: Any = None, p2p: bool = False) -> Handle:
        """Issue ``fn(group)`` on this generation's group for the device of ``on`` (a tensor, or
        a list of them: the device group for CUDA tensors when there is one, else gloo) and
        return its completion, which :meth:`abort` fails. The data-parallel communicator waits
        on these directly; c10d callers get them wrapped as a ``dist.Work`` (the subclass's
        ``_issue``). ``p2p``: ``fn`` posts a send or a receive (on gloo, a work with no future)."""
        with self._lock:
            if self._aborted is not None or self._pg is None:
                raise CommAborted(f"group {self.key} generation {self.generation} aborted: {self._aborted}")
            dev = self._dev_pg is not None and on_cuda(on)
            pg = self._dev_pg if dev else self._pg
            work = fn(pg)
            # gloo is polled by the waiting thread; NCCL completes through its future
            futureless = p2p and isinstance(pg, dist.ProcessGroupGloo)
            h = Handle(work, result, self._forget_weakly, poll=not dev, futureless=futureless)
            if not h.done():
                self._pending.add(h)
        return h

    def _forget(self, h: Handle) -> None:
        with self._lock:
            self._pending.discard(h)


def _call_if_alive(method: weakref.WeakMethod[Callable[[Handle], None]], h: Handle) -> None:
    """``method(h)`` if its object is still alive (a group gone has nothing left to forget)."""
    fn = method()
    if fn is not None:
        fn(h)


def _store_chain(store: Any) -> list[Any]:
    """``store`` and every store it wraps (a ``PrefixStore``'s ``underlying_store``), outermost
    first: holding them holds the innermost Python store too."""
    chain = [store]
    while isinstance(chain[-1], dist.PrefixStore):
        chain.append(chain[-1].underlying_store)
    return chain


def on_cuda(x: Any) -> bool:
    """Whether ``x`` (a tensor, or a list of tensors or of lists of them) lives on a GPU."""
    while isinstance(x, list | tuple) and x:
        x = x[0]
    return isinstance(x, torch.Tensor) and x.is_cuda
