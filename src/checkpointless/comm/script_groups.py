"""Groups that the script (or a framework) makes with ``dist.new_group``, resilient like the rest.

Lightning, Megatron, DeepSpeed and Accelerate make their own groups with ``dist.new_group`` and
``dist.new_subgroups`` (Lightning around every ``prepare_data``, with ``backend="gloo"`` and a
timeout of 10000 days). torch 2.13 hands a ``new_group`` to the default group when that group
has a callable ``new_group`` of its own (``_new_group_with_tag``), and the job's default group
is ours (recovery/default_group.py), so :class:`ScriptGroups` is handed every such call:

- it returns a :class:`~checkpointless.comm.process_group.ResilientProcessGroup` over the ranks
  asked for whatever ``backend`` was named ("gloo" on CPU, or none, or the job's): the same Python
  object for the rest of the job, whose communicator the job forms in every generation and whose
  collectives a fault aborts (a waiter wakes with ``CommAborted`` and the step is replayed); a
  rank outside the group gets ``None``, which torch turns into ``GroupMember.NON_GROUP_MEMBER``;
- each group is keyed by torch's name for it (its creation sequence number, the same on every
  rank because torch requires every rank to call ``new_group`` in the same order) and its ranks
  (:func:`group_key`), under ``groups/gen<g>/`` in the generation's store: apart from the default
  group's, the data-parallel communicator's and the mesh's keys;
- in every generation, before any group forms, each rank publishes the groups it has made and
  checks its co-members' lists, so a group that some ranks never made is a
  :class:`GroupsDisagree` error naming it (:func:`disagreement`), not a wait for ever;
- a group made while a generation is live (under plain torchrun, run plainly, or inside the step
  loop) forms at once from that generation's store; one whose members never all arrive is a
  :class:`GroupsDisagree` naming the ranks that did not, at the recovery timeout;
- a timeout beyond what ``select``/``poll`` accept (Lightning's 10000 days) is clamped
  (:func:`clamp_timeout`).

``dist.split_group`` (torch's refuses any backend without native splitting, gloo included) is
rebound while the job's default group is the world's, to the ``new_group`` calls it amounts to,
one per split (comm/split_group.py), so its groups come here too.

The groups of ``job.device_mesh()`` go through the same path; the mesh makes them inside
:func:`made_by_mesh` and drives them itself (comm/mesh.py).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from checkpointless.comm.group_catalog import (
    GroupEntry,
    GroupsDisagree,
    disagreement,
    group_key,
    parse_catalog,
)
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.comm.work import MAX_TIMEOUT, clamp_timeout
from checkpointless.errors import CommAborted, RendezvousError

__all__ = [
    "MAX_TIMEOUT",
    "GroupEntry",
    "GroupsDisagree",
    "ScriptGroups",
    "clamp_timeout",
    "disagreement",
    "group_key",
    "made_by_mesh",
    "made_by_torch",
    "parse_catalog",
    "torch_delegates_new_group",
]

_PREFIX = "groups/"  # apart from "default/", the communicator's "dp/" and the mesh's "gen<g>/"
_POLL_S = 0.005
_SEALED = "sealed/"  # each rank's list of groups once it has reached job.steps() (seal)


def torch_delegates_new_group() -> bool:
    """Whether this torch hands ``dist.new_group`` to a default group with a ``new_group`` of its
    own (torch 2.13 does: ``_new_group_with_tag`` reads ``default_pg.new_group``). An older one
    makes the group itself: then a script's group is never formed by the job."""
    from torch.distributed import distributed_c10d

    fn = getattr(distributed_c10d, "_new_group_with_tag", None)
    return fn is not None and "new_group" in fn.__code__.co_names


_mesh_depth = 0  # > 0 while job.device_mesh() makes its groups (made_by_mesh)


@contextlib.contextmanager
def made_by_mesh() -> Iterator[None]:
    """Groups made inside this are a mesh's: keyed by their members and driven by the mesh."""
    global _mesh_depth
    _mesh_depth += 1
    try:
        yield
    finally:
        _mesh_depth -= 1


@contextlib.contextmanager
def made_by_torch() -> Iterator[None]:
    """Groups made inside this are torch's own c10d groups, not the job's.

    For a group no recovery ever drives: DCP's one-rank CPU group (state/checkpoint_writer.py) must carry a
    real gloo backend for ``async_save``'s check, is made by one rank alone (so it would fail the
    ranks' group-list check) and runs no collective. torch delegates ``new_group`` only while the
    default group has a callable ``new_group``, so the hook is hidden for the call. Made on the
    thread that checkpoints, between steps; a script's ``new_group`` on another thread at that
    instant would be torch's too, which no script does while its own rank saves.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    hook = getattr(world, "new_group", None) if isinstance(world, ResilientProcessGroup) else None
    if world is None or hook is None:
        yield
        return
    world.new_group = None
    try:
        yield
    finally:
        world.new_group = hook


@dataclass
class _Made:
    entry: GroupEntry
    pg: ResilientProcessGroup | None  # None on a rank outside the group


class ScriptGroups:
    """Every group the script made through torch's default group, driven through generations."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        device_backend: str | None,
        on_collective: Callable[[str], None] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout  # the recovery timeout: how long a group may take to form
        self.device_backend = device_backend
        self.on_collective = on_collective
        self._made: list[_Made] = []  # in creation order: the order every rank forms them in
        self._lock = threading.Lock()
        self._live: tuple[int, dist.Store] | None = None  # the formed generation and its store
        self._cancel = threading.Event()  # set by abort: ends a formation in flight
        self._folded: frozenset[str] = frozenset()  # degraded mode: groups this process is all of

    # -- torch's new_group, handed to us ----------------------------------------------------------
    def create(
        self,
        ranks: Sequence[int],
        timeout: datetime.timedelta | None = None,
        pg_options: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
    ) -> ResilientProcessGroup | None:
        """What ``dist.new_group`` (torch's ``_new_group_with_tag``) calls on the default group:
        the group over ``ranks`` (global ranks, sorted by torch), or None on a non-member.
        ``pg_options`` (a backend's options, e.g. NCCL's stream priority) has no meaning for the
        group's gloo communicator and is ignored."""
        members = tuple(int(r) for r in ranks)
        name = str(group_name)
        entry = GroupEntry(name, members)
        mesh = _mesh_depth > 0
        pg = None
        if self.rank in members:
            pg = ResilientProcessGroup(
                members.index(self.rank),
                len(members),
                members,
                clamp_timeout(timeout) or self.timeout,
                key=None if mesh else entry.key,  # a mesh's groups are keyed by members (mesh.py)
                device_backend=self.device_backend,
            )
            pg.name_as(name, group_desc or pg.key)
            pg.before_collective = self.on_collective
        if mesh:
            return pg
        made = _Made(entry, pg)
        if pg is not None:
            pg.on_shutdown = self._forget
        with self._lock:
            self._made.append(made)
            live = self._live
        if pg is not None and live is not None:
            self._form_now(made, *live)
        return pg

    def _forget(self, pg: ResilientProcessGroup) -> None:
        """``dist.destroy_process_group(group)``: no later generation forms it."""
        with self._lock:
            self._made = [m for m in self._made if m.pg is not pg]
        pg.close()  # on the script's thread, as torch's own shutdown would

    def _form_now(self, made: _Made, generation: int, store: dist.Store) -> None:
        """A group made while a generation is live forms at once from its store."""
        assert made.pg is not None
        joined = dist.PrefixStore(f"{made.entry.key}/made/", store)
        joined.set(str(self.rank), b"1")
        if not self._await_makers(made.entry, joined, store):
            return  # a fault: the next generation forms it with the others
        try:
            made.pg.configure(
                generation, store, time.monotonic() + self.timeout.total_seconds(), self._cancel
            )
        except RendezvousError:
            if self._cancel.is_set():
                return  # a fault: the next generation forms it with the others
            absent = [r for r in made.entry.ranks if not joined.check([str(r)])]
            if not absent:
                raise
            raise GroupsDisagree(
                f"{made.entry.describe()} was made on rank {self.rank} while generation "
                f"{generation} was live, but ranks {absent} never made it within "
                f"{self.timeout.total_seconds():.0f} s; every rank must call dist.new_group the "
                "same number of times, in the same order"
            ) from None

    def _await_makers(self, entry: GroupEntry, joined: dist.Store, store: dist.Store) -> bool:
        """Wait until every member of ``entry`` has made it; False if a fault cancelled the wait.
        A member that has sealed its list without it (:meth:`seal`) never will: that is a
        :class:`GroupsDisagree` naming the group at once, not a wait until the timeout."""
        peers = [r for r in entry.ranks if r != self.rank]
        sealed = dist.PrefixStore(_SEALED, store)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline:
            absent = [r for r in peers if not joined.check([str(r)])]
            if not absent:
                return True
            done = [r for r in absent if sealed.check([str(r)])]
            theirs = {r: parse_catalog(sealed.get(str(r)).decode()) for r in done}
            # only this group is judged: the peers' sealed lists hold groups this rank has yet
            # to make (judged against [entry] alone they read as groups it never made)
            why = disagreement([entry], self.rank, theirs, only=entry) if theirs else None
            if why is not None:
                raise GroupsDisagree(why)
            if len(done) == len(absent):
                # every member still unheard has sealed a list that holds this group: it made
                # it, and the formation below meets it (its mark may not be readable here yet)
                return True
            if self._cancel.is_set():
                return False
            time.sleep(_POLL_S)
        return True  # the formation below names who never came

    def seal(self) -> None:
        """This rank has made every group it will make before its loop (``job.steps()`` begins):
        publish the list in the live generation, so that a peer waiting for a group this rank
        never made learns it at once (:meth:`_await_makers`)."""
        with self._lock:
            live = self._live
            lines = "\n".join(m.entry.line() for m in self._made)
        if live is not None:
            dist.PrefixStore(_SEALED, live[1]).set(str(self.rank), lines.encode())

    # -- generations -------------------------------------------------------------------------------
    def fold(self, keys: frozenset[str]) -> None:
        """Degraded mode (group_catalog.held_groups): the groups keyed ``keys`` have this process as
        every member, and form no communicator until a later round unfolds them (``keys`` empty
        at full width). Set before :meth:`configure`."""
        with self._lock:
            self._folded = keys
            for m in self._made:
                if m.pg is not None:
                    m.pg.folded = m.entry.key in keys

    def configure(
        self, generation: int, store: dist.Store, deadline: float, cancelled: threading.Event | None
    ) -> None:
        """Check that every member made the same groups, then form each of this rank's groups of
        ``generation`` in creation order (the same global order on every rank)."""
        gen_store = dist.PrefixStore(f"{_PREFIX}gen{generation}/", store)
        with self._lock:
            made = list(self._made)
        self._agree(gen_store, [m.entry for m in made], deadline, cancelled)
        for m in made:
            if m.pg is not None and not m.pg.folded:  # a folded group has no other process
                m.pg.configure(generation, gen_store, deadline, cancelled)
        with self._lock:
            self._live = (generation, gen_store)
            self._cancel.clear()
            late = [m for m in self._made if m not in made and m.pg is not None]
        for m in late:  # made on another thread while the others formed
            self._form_now(m, generation, gen_store)

    def _agree(
        self, store: dist.Store, entries: list[GroupEntry], deadline: float, cancelled: threading.Event | None
    ) -> None:
        # every rank publishes, so that a rank that made no group is seen to have made none
        catalog = dist.PrefixStore("catalog/", store)
        catalog.set(str(self.rank), "\n".join(e.line() for e in entries).encode())
        mine = [e for e in entries if self.rank in e.ranks]
        # a folded group's other members are held slots: no process publishes their lists
        peers = sorted({r for e in mine if e.key not in self._folded for r in e.ranks if r != self.rank})
        if not peers:
            return
        keys = [str(r) for r in peers]
        while not catalog.check(keys):
            if cancelled is not None and cancelled.is_set():
                raise RendezvousError("script groups: cancelled by a newer fault")
            if time.monotonic() > deadline:
                raise RendezvousError(f"script groups: ranks {peers} published no group list in time")
            time.sleep(_POLL_S)
        theirs = {r: parse_catalog(catalog.get(str(r)).decode()) for r in peers}
        why = disagreement(mine, self.rank, theirs)
        if why is not None:
            raise GroupsDisagree(why)

    def abort(self, reason: str) -> int:
        """Abort every group (thread-safe); how many collectives were pending."""
        with self._lock:
            self._live = None
            self._cancel.set()
            groups = [m.pg for m in self._made if m.pg is not None]
        return sum(pg.abort(reason) for pg in groups)

    def check(self) -> None:
        """CommAborted if a group was aborted: its collectives of this step may be cut off."""
        for pg in self.groups():
            if pg.aborted is not None:
                raise CommAborted(f"{pg.key} aborted: {pg.aborted}")

    def release(self) -> None:
        for pg in self.groups():
            pg.release_graveyard()

    def close(self) -> None:
        for pg in self.groups():
            pg.close()

    def groups(self) -> list[ResilientProcessGroup]:
        """This rank's groups, in creation order."""
        with self._lock:
            return [m.pg for m in self._made if m.pg is not None]

    def entries(self) -> list[GroupEntry]:
        """Every group made (this rank a member or not), in creation order."""
        with self._lock:
            return [m.entry for m in self._made]
