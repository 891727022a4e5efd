"""The job's process groups, driven together through every generation.

A job has up to three: the data-parallel :class:`~checkpointless.comm.communicator.Communicator`,
torch's default group (``default_group.py``: ``dist.all_reduce``, ``dist.barrier``) and, after
``job.device_mesh()``, the groups of a sharded mesh (``sharded.py``). A fault aborts all of them at
once, a new generation forms all of them from the same store, and an update is refused if any
was aborted during its step. :class:`Groups` owns the three and is the one place that says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from checkpointless.comm.communicator import Communicator
from checkpointless.comm.mesh import hold_replica_reduce
from checkpointless.recovery.default_group import DefaultGroup
from checkpointless.recovery.sharded import ShardedRun
from checkpointless.recovery.slots import HeldSlots

__all__ = ["Groups"]


class Groups:
    """The communicator, torch's default group (once installed) and the mesh (once made)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.default: DefaultGroup | None = None  # torch's default group (dist.all_reduce, barrier)
        self.mesh: ShardedRun | None = None  # job.device_mesh(): FSDP2/HSDP over resilient groups
        self.held = HeldSlots()  # degraded mode: the groups of the slots held besides our own
        self._replica_reduce = True  # FSDP2 all-reduces over the replicate group (begin_pass)

    @property
    def shards(self) -> int:
        """How many shards the state is split into (1 without a mesh)."""
        return self.mesh.shards if self.mesh is not None else 1

    def hold_replicas(self, slots: Sequence[int]) -> None:
        """Degraded HSDP: while this process holds the slots of a replica group that left
        (``slots``), it is every member of its replicate group, which is folded and forms no
        communicator (comm/folded.py); back at full width the group forms again. Set before the
        generation's groups form. A mesh the script made itself cannot fold: ConfigError."""
        if self.mesh is not None and (slots or any(pg.folded for pg in self.mesh.mesh.groups)):
            self.mesh.mesh.fold_replicas(bool(slots))

    def begin_pass(self, modules: Sequence[nn.Module], last_pass: bool) -> None:
        """A pass of a step begins: on a mesh, FSDP2 all-reduces over the replicate group only in
        the last one, the earlier passes' reduce-scattered gradients kept and added to it
        (comm/mesh.py, ``hold_replica_reduce``). Nothing to do at full width."""
        if self.mesh is None or last_pass == self._replica_reduce:
            return
        for m in modules:
            hold_replica_reduce(m, last_pass)
        self._replica_reduce = last_pass

    def abort(self, reason: str) -> int:
        """Fail every pending collective of every group now (thread-safe); how many there were."""
        n = self.comm.abort(reason)
        if self.default is not None:
            n += self.default.abort(reason)
        if self.mesh is not None:
            n += self.mesh.abort(reason)
        return n + self.held.abort(reason)

    def aborted(self) -> str | None:
        """Why the communicator or a mesh group was aborted, or None while they are live."""
        return self.comm.aborted or (self.mesh.aborted() if self.mesh is not None else None)

    def check(self) -> None:
        """Raise CommAborted if any group was aborted: never apply an update from such a step."""
        self.comm.check()
        if self.default is not None:
            self.default.check()
        if self.mesh is not None:
            self.mesh.check()

    def rebuild(
        self,
        generation: int,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float,
        cancelled: threading.Event,
    ) -> float:
        """Form every group of ``generation`` from ``store`` (each within ``timeout`` seconds);
        the seconds the communicator waited for its peers."""
        wait_s = self.comm.rebuild(generation, store, rank, world_size, time.monotonic() + timeout, cancelled)
        if self.default is not None:
            self.default.configure(generation, store, time.monotonic() + timeout, cancelled)
        if self.mesh is not None:
            self.mesh.configure(generation, store, time.monotonic() + timeout, cancelled)
        return wait_s

    def reset(self, modules: Sequence[nn.Module]) -> None:
        """What an abandoned forward/backward left in FSDP2 (nothing without a mesh)."""
        if self.mesh is not None:
            self.mesh.reset(modules)

    def release(self) -> None:
        """Drop the groups the last generation parked, once the new one has formed."""
        self.comm.release_graveyard()
        self.held.release()
        if self.default is not None:
            self.default.release()
        if self.mesh is not None:
            self.mesh.release()

    def close(self) -> None:
        """At a normal exit (torchrun, run plainly): every group closed before the process ends."""
        self.comm.close()
        if self.default is not None:
            self.default.close()  # with the groups the script made
        if self.mesh is not None:
            for pg in self.mesh.mesh.groups:  # the world group may be the default group: twice is fine
                pg.close()
