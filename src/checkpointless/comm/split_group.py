"""``dist.split_group`` under a checkpointless job: resilient groups, as ``dist.new_group`` makes.

torch 2.13's ``split_group`` splits the parent's communicator natively (``ncclCommSplit``): it
refuses a group whose backend cannot split ("its backend does not support splitting"), on CPU
always, and it never asks the default group, as ``new_group`` does (comm/script_groups.py). Under
a job it could not work as is, on CPU or GPU. :func:`split_group` here has torch's signature and
semantics, expressed as the ``new_group`` calls they amount to: one per split, in order, over the
split's ranks translated to global ranks through the parent's group ranks. Each call reaches the
job's :class:`~checkpointless.comm.script_groups.ScriptGroups` like any other, so the split
groups are named, catalogued, checked across ranks, formed in every generation and aborted by a
fault with no code of their own, and this rank gets the same Python object for the whole job.

- Every rank of the parent calls it with the same ``split_ranks`` (the parent's group ranks);
  this rank gets the group of the split it is in, or None if it is in none (torch's return).
- A parent over every rank (the default group, or a ``new_group`` of all ranks) makes each split
  with a plain ``new_group``: every rank calls every one, so torch's sequence names stay in step.
  A parent over some ranks is called by those ranks only, so the world's sequence numbers
  cannot name its splits (they would drift apart between the parent's ranks and the others), nor
  can torch's ``use_local_synchronization`` hash (it counts the groups each rank is in, which
  differs between the members of one split). Each split is named ``<parent>_split<n>_<i>``: the
  parent's name, how many times this parent was split before and the split's place, the same on
  every member; only its members make it, through the same hook and torch's same bookkeeping
  (:func:`_member_group`).
- Invalid input raises torch's ``ValueError`` for it, checked on every split before any group is
  made (torch stops at this rank's own split), so every rank refuses the same call alike.
- ``pg_options`` is handed on (a gloo communicator ignores it), ``backend`` too (it names the
  group's backend as ``dist.get_backend`` reports it), and ``timeout`` is clamped as a
  ``new_group``'s is.

**Why a patch.** torch's ``split_group`` reads the default group's device and backend before any
hook could be asked, so the call must be caught before torch's code runs. :func:`install`
rebinds the names that reach it (``torch.distributed.split_group``, ``distributed_c10d.split_group``
and ``device_mesh``'s own import of it) when the job makes its default group, and :func:`uninstall`
puts torch's back when the job closes it. In between, the replacement hands every call to torch's
own unless the world's default group is the job's and offers its ``new_group`` hook
(:func:`~checkpointless.comm.script_groups.made_by_torch` hides that hook), so a process whose
default group is torch's sees torch's behaviour exactly.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from checkpointless.comm.process_group import ResilientProcessGroup

__all__ = ["global_splits", "install", "installed", "split_group", "uninstall"]

_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.device_mesh")
_torch_split: Callable[..., Any] = c10d.split_group  # torch's own, at import
# how many times each parent over some ranks (by name) was split: names its splits alike on
# every member, since torch has every rank of the parent split it in the same order
_split_count: dict[str, int] = {}


def global_splits(split_ranks: Any, parent_ranks: Sequence[int], world_size: int) -> list[list[int]]:
    """Each split of ``split_ranks`` (group ranks of a parent whose global ranks are
    ``parent_ranks``) as sorted global ranks, or torch's ``ValueError`` for invalid input. Pure:
    every rank reaches the same answer from the same call."""
    if split_ranks is None or len(split_ranks) == 0:
        raise ValueError("split_ranks cannot be None or empty")
    out: list[list[int]] = []
    seen: dict[int, int] = {}  # group rank -> the split it was first in
    for i, split in enumerate(split_ranks):
        ranks = [int(r) for r in split]
        if len(ranks) == 0:
            raise ValueError(f"the split group cannot be empty (split {i} of {list(split_ranks)})")
        if len(ranks) > world_size:
            raise ValueError(
                f"the split group's size should be less or equal to the world_size set by "
                f"init_process_group (split {i} has {len(ranks)} ranks, the world {world_size})"
            )
        if len(ranks) != len(set(ranks)):
            raise ValueError(f"the split group cannot have duplicate ranks (split {i}: {ranks})")
        for r in ranks:
            if not 0 <= r < len(parent_ranks):
                raise ValueError(
                    f"rank {r} of split {i} is not a group rank of the parent group, whose ranks "
                    f"are 0 to {len(parent_ranks) - 1}"
                )
            if r in seen:
                raise ValueError(
                    f"rank {r} is in split {seen[r]} and in split {i}: the splits must not overlap"
                )
            seen[r] = i
        out.append(sorted(parent_ranks[r] for r in ranks))
    return out


def _ours() -> ResilientProcessGroup | None:
    """The job's default group while it takes ``new_group`` calls, else None (torch's world)."""
    if not dist.is_initialized():
        return None
    world = c10d._get_default_group()
    if isinstance(world, ResilientProcessGroup) and callable(getattr(world, "new_group", None)):
        return world
    return None


def split_group(
    parent_pg: dist.ProcessGroup | None = None,
    split_ranks: list[Any] | None = None,
    timeout: datetime.timedelta | None = None,
    pg_options: Any | None = None,
    group_desc: str | None = None,
    backend: str | dist.Backend | None = None,
) -> dist.ProcessGroup | None:
    """torch's ``split_group``: under the job, the ``new_group`` calls it amounts to (module doc)."""
    world = _ours()
    if world is None:
        return _torch_split(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
    if split_ranks is None or len(split_ranks) == 0:  # torch checks it first, before the parent
        raise ValueError("split_ranks cannot be None or empty")
    parent = parent_pg or world
    if parent not in c10d._world.pg_group_ranks:
        raise ValueError(f"Group {parent} is not registered")
    parent_ranks = dist.get_process_group_ranks(parent)
    me = dist.get_rank()
    if me not in parent_ranks:
        raise ValueError(f"Global rank {me} is not part of the parent group {parent}")
    size = dist.get_world_size()
    splits = global_splits(split_ranks, parent_ranks, size)
    if sorted(parent_ranks) == list(range(size)):  # every rank calls: torch's own new_group
        made = [
            dist.new_group(
                ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc
            )
            for ranks in splits
        ]
        return next((pg for pg, ranks in zip(made, splits, strict=True) if me in ranks), None)
    parent_name = c10d._get_process_group_name(parent)
    n = _split_count.get(parent_name, 0)
    _split_count[parent_name] = n + 1
    for i, ranks in enumerate(splits):
        if me in ranks:
            name = f"{parent_name}_split{n}_{i}"
            return _member_group(world, ranks, name, timeout, pg_options, group_desc, backend)
    return None


def _member_group(
    world: ResilientProcessGroup,
    ranks: list[int],
    name: str,
    timeout: datetime.timedelta | None,
    pg_options: Any,
    group_desc: str | None,
    backend: str | dist.Backend | None,
) -> dist.ProcessGroup:
    """What torch's ``new_group`` does with a default group that makes groups itself
    (``_new_group_with_tag``), under a name of our choosing: the job's group over ``ranks``,
    registered where torch's helpers (``get_process_group_ranks``, ``get_rank(group)``, the
    registry functional collectives resolve names in) look for it."""
    default_backend, default_store = c10d._world.pg_map[world]
    be = dist.Backend(str(backend or default_backend))
    if timeout is None:
        timeout = c10d._get_default_timeout(be)
    c10d._check_valid_timeout(timeout)
    make = world.new_group
    assert make is not None, "checked by _ours()"
    pg = make(ranks, timeout=timeout, pg_options=pg_options, group_name=name, group_desc=group_desc)
    assert pg is not None, "the job's new_group makes a group for its member"
    c10d._register_pg_in_world(
        pg,
        backend_name=be,
        store=dist.PrefixStore(f"{name}/", default_store),
        group_name=name,
        backend_config=str(c10d.BackendConfig(be)),
        rank_mapping={g: i for i, g in enumerate(ranks)},
    )
    return pg


def install() -> None:
    """Route ``dist.split_group`` here (idempotent); torch's own runs outside a job."""
    for name in _MODULES:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "split_group", None) is _torch_split:
            mod.split_group = split_group  # type: ignore[attr-defined]


def uninstall() -> None:
    """Put torch's own ``split_group`` back where :func:`install` rebound it."""
    for name in _MODULES:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "split_group", None) is split_group:
            mod.split_group = _torch_split  # type: ignore[attr-defined]
    _split_count.clear()


def installed() -> bool:
    return dist.split_group is split_group
