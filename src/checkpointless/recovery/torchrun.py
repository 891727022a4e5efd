"""The variables a torchrun-style script reads, set by ``checkpointless.init()``.

Ranks are placed host-major (``coordinator/placement.py``): rank ``r`` of a job with ``P``
processes per node is local rank ``r % P`` on node ``r // P``, and the ``Assign`` message carries
those numbers. A job on one machine is one node, so there the local numbers are the global ones.
A hot spare has none of the variables while it waits: they are set when ``init()`` returns with
the rank it was given, before any line of the script after ``init()`` runs.
"""

from __future__ import annotations

import os

__all__ = ["TORCHRUN_VARIABLES", "export_torchrun_env", "torchrun_env"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


def torchrun_env(
    rank: int, world_size: int, local_rank: int = -1, local_world_size: int = -1, node_rank: int = -1
) -> dict[str, str]:
    """What torchrun would set for ``rank`` of ``world_size``; without a placement (-1), the
    whole job is one node."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if local_world_size < 1:  # one host: the local rank is the global rank
        local_rank, local_world_size, node_rank = rank, world_size, 0
    if not 0 <= local_rank < local_world_size or node_rank < 0:
        raise ValueError(
            f"placement local rank {local_rank} of {local_world_size} on node {node_rank} is impossible"
        )
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),  # the name torchrun's --node-rank flag and many scripts use
    }


def export_torchrun_env(
    rank: int,
    world_size: int,
    *,
    keep_existing: bool = False,
    placement: tuple[int, int, int] = (-1, -1, -1),
) -> None:
    """Set the variables; ``placement`` is (local rank, local world size, node rank) from the
    coordinator. ``keep_existing`` leaves ones already set alone (a single-process job started by
    another launcher keeps what that launcher said)."""
    for name, value in torchrun_env(rank, world_size, *placement).items():
        if not (keep_existing and name in os.environ):
            os.environ[name] = value
