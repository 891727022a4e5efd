"""The variables a torchrun-style script reads, set by ``checkpointless.init()``.

Ranks are placed host-major (``coordinator/rules/placement.py``): rank ``r`` of a job with ``P``
processes per node is local rank ``r % P`` on node ``r // P``, and the ``Assign`` message carries
those numbers. A job on one machine is one node, so there the local numbers are the global ones.
A hot spare has none of the variables while it waits: they are set when ``init()`` returns with
the rank it was given, before any line of the script after ``init()`` runs.

The other direction: an adopted script started by plain ``torchrun`` has torchrun's variables and
store but no launcher of ours. It must not become N single-process jobs (each training alone and
all writing the same files), so ``init()`` joins torchrun's rendezvous as one job that does not
recover (:func:`join_torchrun_group`): the job's groups (torch's default group, its communicator,
a device mesh's groups) form once from torchrun's store. It says so once per rank, and starts
every rank from its shard's holder in the first replica group (rank 0 in data parallelism) as the
launcher's first round would (:func:`start_from_first_replica`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from checkpointless.errors import ConfigError
from checkpointless.state.snapshot import (
    Stateful,
    capture_rng,
    collect_state,
    landing_zone,
    restore_state,
)
from checkpointless.state.transfer import receive_state, send_state

__all__ = [
    "TORCHRUN_VARIABLES",
    "export_torchrun_env",
    "join_torchrun_group",
    "start_from_first_replica",
    "started_by_torchrun",
    "torchrun_env",
    "torchrun_warning",
]

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


# -- a script started by plain torchrun ---------------------------------------------------------
# torchrun (torch.distributed.run) sets these for every process it starts; TORCHELASTIC_RUN_ID is
# torchrun's alone, the others are the env:// rendezvous every launcher of that style provides.
_TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def started_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when another launcher (torchrun or the like) started N processes of this script:
    its rendezvous variables are there and its world is larger than one."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env and not all(v in env for v in _TORCHRUN_MARKERS[1:]):
        return False
    try:
        return int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" in env
    except ValueError as e:
        raise ConfigError(
            f"WORLD_SIZE={env.get('WORLD_SIZE')!r} is not a number; torchrun sets it to the number of processes"
        ) from e


def torchrun_warning(rank: int, world_size: int) -> str:
    """The one line each rank prints when it runs under plain torchrun."""
    return (
        f"rank {rank} of {world_size}: started by torchrun, so this job runs WITHOUT in-process "
        "recovery (a fault ends it, as under torchrun); for recovery start it with "
        f"`checkpointless run --nproc {world_size} --spares 1 <script> [args...]`"
    )


def join_torchrun_group(timeout: datetime.timedelta) -> tuple[int, int, dist.Store, bool]:
    """Join torchrun's rendezvous (env://); return (rank, world size, torchrun's store, whether
    torch's default group is still to be made). A script that initialised torch.distributed
    before ``init()`` keeps its group (False); otherwise the job makes the default group its own
    resilient one, as under the launcher, so that a device mesh can adopt it (True)."""
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        return dist.get_rank(), dist.get_world_size(), store, False
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return rank, world_size, store, True


def start_from_first_replica(
    comm: Any,
    objects: dict[str, Stateful],
    start: int,
    rank: int,
    world_size: int,
    timeout: float,
    shards: int = 1,
) -> int:
    """What the launcher's first round does, done over the job's own group: every rank takes the
    tracked state and start step of the rank that holds its shard in the first replica group,
    rank ``rank % shards`` (with one shard that is rank 0, as DDP broadcasts rank 0's weights at
    construction; a sharded mesh with one replica group has nothing to send), and keeps its own
    generators (per-rank state, as under DDP: recovery/rank_rng.py). Returns the start step."""
    if world_size <= shards:
        return start
    rng = capture_rng()
    source = rank % shards
    if rank == source:
        peers = list(range(rank + shards, world_size, shards))
        send_state(comm, collect_state(objects, start, rng), peers, timeout)
        return start
    own = landing_zone(objects, start, rng)
    state, _ = receive_state(comm, source, timeout, own)
    step, _ = restore_state(objects, state)
    return step
