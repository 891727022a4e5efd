"""The data-parallel slots this process holds besides its own, while the job runs degraded.

A plan with ``holders`` (protocol/plan.py) gives a live process a lost rank's slot: it trains
that slot's micro-batch as an extra pass of every step, and it is that slot's rank in the job's
width-N groups, so the all-reduce of every slot's gradient is the full-width job's own
(comm/data_parallel.py, ``DataParallel.hold``) and the result stays bitwise the same. Here: the
groups of each held slot (the data-parallel communicator and, when installed, torch's default
group), formed beside this process's own in every generation, aborted with them, and a barrier
that waits on all of them. docs/fault-model.md, "Degraded mode", says what a script may do in a
degraded step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from checkpointless.comm.communicator import Communicator
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.recovery.default_group import DefaultGroup

__all__ = ["HeldSlots"]


class HeldSlots:
    """The slots held besides this process's own (empty at full width), with their groups."""

    def __init__(self) -> None:
        self.slots: list[int] = []  # in pass order, after this process's own slot
        self._comms: dict[int, Communicator] = {}
        self._defaults: dict[int, DefaultGroup] = {}
        # the groups of slots spares took back: aborted, their parked gloo groups dropped by
        # release() off the training thread, the objects kept (a store outlives its group)
        self._retired: list[Communicator | DefaultGroup] = []

    def passes(self, own: int) -> list[int]:
        """The slots a step trains, in pass order: this process's own first (its random numbers
        are drawn first, as at full width), then the held ones."""
        return [own, *self.slots]

    def comms(self, own: Communicator) -> list[Communicator]:
        """The data-parallel group of every slot in pass order (``DataParallel.hold``)."""
        return [own, *(self._comms[s] for s in self.slots)] if self.slots else []

    def start_forming(
        self,
        slots: list[int],
        world_size: int,
        generation: int,
        store_for: Callable[[int], dist.Store],
        own: Communicator,
        default: DefaultGroup | None,
        deadline: float,
        cancelled: threading.Event,
    ) -> list[threading.Thread]:
        """Begin forming the groups of generation ``generation`` for ``slots`` (the held slots of
        the plan), each on a thread: every group waits for its whole width, this process's own
        membership included, so they must form while its own groups do. ``store_for(slot)``: the
        generation's store as that slot's rank sees it."""
        for gone in set(self._comms) - set(slots):  # a spare took it back
            # Not closed here: destroying a gloo group whose collective the grow round cut off
            # joins gloo's threads, which wait out that collective's timeout, and every member
            # of the new generation waited that long for this one (seen: 60 s, the job then
            # recovered once more). Aborted now, dropped off this thread by release().
            retired: list[Communicator | DefaultGroup] = [self._comms.pop(gone)]
            d = self._defaults.pop(gone, None)
            if d is not None:
                retired.append(d)
            for group in retired:
                group.abort(f"slot {gone} is a process's own again")
            self._retired.extend(retired)
        self.slots = list(slots)
        threads: list[threading.Thread] = []
        for slot in slots:
            comm = self._comms.get(slot)
            if comm is None:
                comm = self._comms[slot] = Communicator(slot, world_size, own.timeout, backend=own.backend)
            shadow = None
            if default is not None and default.active:
                shadow = self._defaults.get(slot)
                if shadow is None:
                    pg = ResilientProcessGroup(
                        slot, world_size, range(world_size), own.timeout, key=default.pg.key
                    )
                    shadow = self._defaults[slot] = DefaultGroup(pg)
            th = _Forming(slot, comm, shadow, generation, store_for(slot), world_size, deadline, cancelled)
            th.start()
            threads.append(th)
        return threads

    @staticmethod
    def finish_forming(threads: list[threading.Thread], deadline: float) -> None:
        """Wait for the groups begun by :meth:`start_forming`; raise the first one's error."""
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        for th in threads:
            if isinstance(th, _Forming) and th.error is not None:
                raise th.error
            if th.is_alive():
                raise TimeoutError(f"the groups of held slot {getattr(th, 'slot', '?')} did not form in time")

    def abort(self, reason: str) -> int:
        """Fail every pending collective of the held slots' groups (thread-safe)."""
        n = 0
        for comm in list(self._comms.values()):
            n += comm.abort(reason)
        for d in list(self._defaults.values()):
            n += d.abort(reason)
        return n

    def barrier(self, own: Communicator, timeout: float | None) -> None:
        """``own.barrier`` for this process and every slot it holds at once (each group waits
        for every slot's rank); ``timeout`` None: until it completes or is aborted."""
        if not self.slots:
            own.barrier(timeout)
            return
        errors: list[BaseException] = []

        def wait(comm: Communicator) -> None:
            try:
                comm.barrier(timeout)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=wait, args=(c,), daemon=True) for c in self.comms(own)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(None if timeout is None else timeout + 5)
        if errors:
            raise errors[0]

    def release(self) -> None:
        """Drop the parked groups of earlier generations and of retired slots (off the training
        thread's hot path)."""
        for comm in self._comms.values():
            comm.release_graveyard()
        for d in self._defaults.values():
            d.release()
        for group in self._retired:
            if isinstance(group, Communicator):
                group.release_graveyard()
            else:
                group.release()


class _Forming(threading.Thread):
    """Forms one held slot's groups of a generation: the communicator, then the default group,
    in the order every member forms them."""

    def __init__(
        self,
        slot: int,
        comm: Communicator,
        default: DefaultGroup | None,
        generation: int,
        store: dist.Store,
        world_size: int,
        deadline: float,
        cancelled: threading.Event,
    ) -> None:
        super().__init__(daemon=True, name=f"cl-slot{slot}-gen{generation}")
        self.slot = slot
        self.error: BaseException | None = None
        self._args: tuple[Any, ...] = (comm, default, generation, store, world_size, deadline, cancelled)

    def run(self) -> None:
        comm, default, generation, store, world_size, deadline, cancelled = self._args
        try:
            comm.rebuild(generation, store, self.slot, world_size, deadline, cancelled)
            if default is not None:
                default.configure(generation, store, deadline, cancelled)
        except BaseException as e:
            self.error = e
