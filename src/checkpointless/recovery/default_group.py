"""torch's default process group for every job: a resilient world group that follows generations.

Plain data-parallel scripts reach for torch's default group without naming it:
``dist.get_rank()``, ``DistributedSampler(dataset)`` with no ``rank``/``num_replicas``,
``dist.all_reduce(metric)`` and ``dist.barrier()``. :func:`install_default_group` makes
that group a :class:`~checkpointless.comm.process_group.ResilientProcessGroup` of all ranks
right after ``init()`` learns this rank, so those calls work with no change to the script.

The group carries no communicator until the job forms a generation; the job then drives it
like the groups of a device mesh: :meth:`DefaultGroup.abort` with the data-parallel
communicator (a metric all-reduce blocked on a dead peer wakes with ``CommAborted``, which
replays the step; on a GPU the host never waits in an all-reduce of a CUDA tensor, and the abort
of the NCCL group's kernels is what ends a later host wait on it, such as ``loss.item()``, after
which the update's check refuses the step), :meth:`DefaultGroup.configure` from the
generation's store, and :meth:`DefaultGroup.release` once the generation has formed. When the
script later calls ``job.device_mesh(...)``, the mesh adopts this very group as its world group
and configures it itself, so :meth:`DefaultGroup.handed_to_mesh` turns this driver off rather
than forming the group twice.

Groups that the script or a framework makes with ``dist.new_group`` or ``dist.new_subgroups``
are handed to this group by torch, and :class:`~checkpointless.comm.script_groups.ScriptGroups`
makes them resilient too: :meth:`DefaultGroup.configure` forms them after the world group in
every generation (also once a mesh drives the world group), and an abort, check and release
reach them with it. ``dist.split_group`` makes its groups through the same ``new_group`` calls
(comm/split_group.py, installed with this group and removed by :meth:`DefaultGroup.close`).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from checkpointless.comm import split_group
from checkpointless.comm.c10d_backend import BACKEND_NAME, register_backend
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.comm.script_groups import ScriptGroups, torch_delegates_new_group
from checkpointless.errors import CommAborted, ConfigError
from checkpointless.events import get_logger

__all__ = ["DefaultGroup", "configure_standalone", "install_default_group"]

log = get_logger()

_STORE_PREFIX = "default/"  # apart from the data-parallel communicator's and the mesh's keys


class DefaultGroup:
    """The job's handle on torch's default group, while the job (not a mesh) drives it."""

    def __init__(self, pg: ResilientProcessGroup, made: ScriptGroups | None = None) -> None:
        self.pg = pg
        self.active = True  # False once a device mesh drives the same group
        # the groups the script made with dist.new_group: driven here whoever drives the world
        self.made = made

    def handed_to_mesh(self) -> None:
        self.active = False

    def configure(
        self, generation: int, store: dist.Store, deadline: float, cancelled: threading.Event | None
    ) -> None:
        if self.active:
            gen_store = dist.PrefixStore(f"{_STORE_PREFIX}gen{generation}/", store)
            self.pg.configure(generation, gen_store, deadline, cancelled)
        if self.made is not None:
            self.made.configure(generation, store, deadline, cancelled)

    def abort(self, reason: str) -> int:
        n = self.pg.abort(reason) if self.active else 0
        return n + (self.made.abort(reason) if self.made is not None else 0)

    def check(self) -> None:
        """Raise CommAborted if the group was aborted during this step: an update must not
        follow a step whose metric reduction was cut off by a fault."""
        if self.active and self.pg.aborted is not None:
            raise CommAborted(f"default group aborted: {self.pg.aborted}")
        if self.made is not None:
            self.made.check()

    def release(self) -> None:
        if self.active:
            self.pg.release_graveyard()
        if self.made is not None:
            self.made.release()

    def close(self) -> None:
        """Every group of this one closed now (a job without our launcher, at its exit)."""
        self.pg.close()
        if self.made is not None:
            self.made.close()
        split_group.uninstall()


def install_default_group(
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    on_collective: Callable[[str], None] | None = None,
) -> DefaultGroup:
    """Make a resilient group of all ranks torch's default group (no communicator yet).

    Raises ConfigError when the script already initialised torch.distributed itself: two
    default groups cannot coexist, and a plain gloo group would hang on a fault."""
    if dist.is_initialized():
        raise ConfigError(
            "torch.distributed is already initialised (dist.init_process_group ran before "
            "checkpointless.init()); remove that call: checkpointless.init() sets up the default "
            "group itself"
        )
    register_backend()
    # c10d's bookkeeping wants a store but sends nothing over it here; every generation's
    # communicator forms from the store handed to configure()
    dist.init_process_group(
        backend=BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=world_size, timeout=timeout
    )
    pg = dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ResilientProcessGroup):  # pragma: no cover - c10d changed its plugin path
        raise ConfigError(f"the default process group is {type(pg).__name__}, expected ours")
    pg.before_collective = on_collective
    if not torch_delegates_new_group():  # pragma: no cover - the package pins torch 2.13
        log.warning(
            "torch %s does not hand dist.new_group to the default group: groups the script makes "
            "with it get no communicator under checkpointless (torch 2.13 does)",
            torch.__version__,
        )
    made = ScriptGroups(rank, world_size, timeout, pg.device_backend, on_collective)
    pg.new_group = made.create  # torch hands dist.new_group to the default group (script_groups.py)
    split_group.install()  # dist.split_group becomes those new_group calls (comm/split_group.py)
    return DefaultGroup(pg, made)


def configure_standalone(group: DefaultGroup) -> None:
    """A world of one, formed at once (the script was run without the launcher)."""
    group.configure(0, dist.HashStore(), time.monotonic() + 30, None)
