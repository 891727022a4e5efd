"""Store-based barriers: a counter barrier for any torch store, a fail-fast one for ours.

``counter``: every rank adds 1 to a counter; the last one to arrive writes a "done" key that
everyone waits for. It works on any torch.distributed store (TCPStore, HashStore, ours) and costs
each rank two requests, but all of them land on the one process that holds the counter, and a
rank that dies before arriving leaves the others waiting until the timeout: nobody can tell
which rank is missing from a count.

``dissemination`` (the default when the rank is known): in round k each rank writes its own flag
``key/k/<rank>`` and waits for the flag of rank ``rank - 2**k``; after ceil(log2 N) rounds every
rank has heard, through a chain of flags, from every other. Each flag is owned by the rank that
writes it (see :mod:`~checkpointless.rendezvous.peers`), so on a :class:`RootlessStore` a reader
waits on the very rank it depends on, and that rank's death is an immediate error naming it.
A rank that fails then writes its remaining flags as "abort: <reason>", so the ranks that depend
on it fail within the same rounds instead of waiting for the timeout. Each rank sends O(log N)
requests and each process serves O(log N): no process carries the barrier.

Use a fresh ``key`` for each barrier (e.g. with the generation and a counter in it).
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING

from checkpointless.errors import ConfigError, RendezvousError
from checkpointless.rendezvous.keyproto import clamp_wait

if TYPE_CHECKING:  # torch.distributed binds Store only at run time, where mypy cannot see it
    from torch._C._distributed_c10d import Store

__all__ = ["store_barrier"]

_ABORT = "abort:"
_OK = "ok"
_MAX_REASON = 800  # a reason travels inside every later flag; keep it a line, not a log


def _left(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _counter_barrier(store: Store, key: str, world_size: int, deadline: float) -> None:
    arrived = int(store.add(f"{key}/count", 1))
    if arrived > world_size:
        raise RendezvousError(
            f"barrier {key!r}: {arrived} arrivals for {world_size} ranks; the key was used before"
        )
    if arrived == world_size:
        store.set(f"{key}/done", _OK)
    store.wait([f"{key}/done"], _left(deadline))


def _dissemination_barrier(store: Store, key: str, rank: int, world_size: int, deadline: float) -> None:
    rounds = (world_size - 1).bit_length()  # ceil(log2(world_size)); 0 for a single rank
    for k in range(rounds):
        store.set(f"{key}/{k}/{rank}", _OK)
        partner = (rank - (1 << k)) % world_size
        flag = f"{key}/{k}/{partner}"
        try:
            store.wait([flag], _left(deadline))
            value = bytes(store.get(flag))
        except (RendezvousError, RuntimeError) as e:  # torch's stores raise RuntimeError subclasses
            reason = f"rank {rank} could not hear from rank {partner}: {e}"
            _abort_later_rounds(store, key, rank, k, rounds, reason)
            raise RendezvousError(f"barrier {key!r} failed: {reason}") from e
        if value != _OK.encode():
            reason = value[len(_ABORT) :].decode(errors="replace")
            _abort_later_rounds(store, key, rank, k + 1, rounds, reason)
            raise RendezvousError(f"barrier {key!r} failed: {reason}")


def _abort_later_rounds(store: Store, key: str, rank: int, start: int, rounds: int, reason: str) -> None:
    """Tell the ranks that will wait on our flags of rounds ``start..`` why they will not come."""
    flag = _ABORT + reason[:_MAX_REASON]
    try:
        for k in range(start, rounds):
            store.set(f"{key}/{k}/{rank}", flag)
    except (RendezvousError, RuntimeError):
        pass  # best effort: the readers still fail, at their own deadline


def store_barrier(
    store: Store,
    key: str,
    world_size: int,
    timeout: datetime.timedelta,
    *,
    rank: int | None = None,
    algorithm: str = "auto",
) -> None:
    """Block until all ``world_size`` ranks reached the barrier named ``key``.

    ``algorithm``: ``"counter"`` (any store, no rank needed), ``"dissemination"`` (needs ``rank``;
    fails fast with the missing rank's name on a :class:`RootlessStore`), or ``"auto"``: the
    latter when the rank is known (given, or the store's own ``rank``), else the former.
    Raises :class:`RendezvousError` on timeout or when a participant is gone.
    """
    if world_size < 1:
        raise ConfigError(f"barrier {key!r}: world size must be at least 1, got {world_size}")
    if rank is None:
        rank = getattr(store, "rank", None)
    if algorithm == "auto":
        algorithm = "counter" if rank is None else "dissemination"
    deadline = time.monotonic() + clamp_wait(timeout.total_seconds())
    if algorithm == "counter":
        try:
            _counter_barrier(store, key, world_size, deadline)
        except RuntimeError as e:
            raise RendezvousError(f"barrier {key!r} failed: {e}") from e
    elif algorithm == "dissemination":
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(
                f"barrier {key!r}: the dissemination barrier needs a rank in 0..{world_size - 1}"
            )
        _dissemination_barrier(store, key, rank, world_size, deadline)
    else:
        raise ConfigError(f"barrier {key!r}: unknown algorithm {algorithm!r} (counter, dissemination, auto)")
