"""The variables a torchrun-style script reads, set by ``checkpointless.init()``.

``checkpointless run`` starts every rank on one machine today, so the local numbers are the
global ones. A hot spare has none of them while it waits: they are set when ``init()`` returns
with the rank it was given, before any line of the script after ``init()`` runs.
"""

from __future__ import annotations

import os

__all__ = ["TORCHRUN_VARIABLES", "export_torchrun_env", "torchrun_env"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def torchrun_env(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun would set for ``rank`` of ``world_size`` processes on a single machine."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    # one host: the local rank is the global rank and the local world is the whole job
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def export_torchrun_env(rank: int, world_size: int, *, keep_existing: bool = False) -> None:
    """Set the variables; ``keep_existing`` leaves ones already set alone (a single-process job
    started by another launcher keeps what that launcher said)."""
    for name, value in torchrun_env(rank, world_size).items():
        if not (keep_existing and name in os.environ):
            os.environ[name] = value
