"""Where each rank's buddy copy lives: ring placement, one host over. Pure functions.

A buddy copy exists to survive the loss of its owner, and the most likely large loss is a whole
host (a kernel panic, a power supply, a network card). So the copy must sit on *another* host.
Ranks are placed host-major (``coordinator/rules/placement.py``: host h runs ranks ``h*P .. h*P+P-1``
with P ranks per host), so the rank one host over, ``(r + P) % W``, is on the next host: every
host's copies lie on the next host and the ring closes at the last. When the last host is only
partly filled the wrap may land on the owner's own host; the next rank off it takes the copy then
(so a keeper may hold two owners' copies). With full hosts each rank keeps exactly one other rank's
copy, so the extra memory per rank is one shard's state (two while a new copy
replaces the old one, see state/buddy_keeper.py).

On one host (``P >= W``) there is no other host; the buddy is then the next rank, ``(r + 1) % W``,
which still survives the loss of the owner's process, though not of the machine.

Clique placement (NVIDIA's local checkpoint cliques: hosts in groups that mirror each other) was
considered: it needs W divisible by the clique size and still loses both copies when two hosts
of one clique fail, the same exposure as the ring for two adjacent hosts. The ring needs nothing
from W and is what this module gives.
"""

from __future__ import annotations

__all__ = ["buddy_of", "host_of", "owners_of"]


def _check(rank: int, world_size: int, per_host: int) -> None:
    if world_size < 1:
        raise ValueError(f"world size must be at least 1 (got {world_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")


def host_of(rank: int, per_host: int) -> int:
    """The host (node rank) a rank runs on under host-major placement."""
    return rank // per_host if per_host > 0 else 0


def buddy_of(rank: int, world_size: int, per_host: int) -> int | None:
    """The rank whose host memory keeps ``rank``'s copy; None when the job has one rank.

    ``per_host`` is the number of ranks per host (torchrun's LOCAL_WORLD_SIZE); 0 or less, or
    at least ``world_size``, means every rank is on one host.
    """
    _check(rank, world_size, per_host)
    if world_size == 1:
        return None
    if per_host <= 0 or per_host >= world_size:
        return (rank + 1) % world_size
    # one host over; on a job whose last host is partly filled the wrap can land back on the
    # owner's host, and then the next rank that is not on it takes the copy
    for k in range(world_size):
        cand = (rank + per_host + k) % world_size
        if host_of(cand, per_host) != host_of(rank, per_host):
            return cand
    raise AssertionError("unreachable: two hosts always hold a rank off the owner's host")


def owners_of(keeper: int, world_size: int, per_host: int) -> list[int]:
    """The ranks whose copies ``keeper`` holds (one in a ring; listed for any placement)."""
    _check(keeper, world_size, per_host)
    return [r for r in range(world_size) if buddy_of(r, world_size, per_host) == keeper]
