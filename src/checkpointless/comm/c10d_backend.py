"""The c10d backend that makes :class:`~checkpointless.comm.process_group.ResilientProcessGroup`.

Registered under :data:`BACKEND_NAME`, ``init_process_group`` and ``new_group`` go through
c10d's backend-plugin path, so torch keeps its own bookkeeping for our groups: the group name,
the registry that ``DeviceMesh.get_group`` and functional collectives resolve names in, and the
global-to-group rank map (``mesh.py`` and ``recovery/default_group.py`` make groups this way).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from checkpointless.comm.handle import default_backend
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.comm.work import clamp_timeout

__all__ = ["BACKEND_NAME", "register_backend"]

BACKEND_NAME = "checkpointless"

_registered = False


def register_backend() -> None:
    """Teach c10d the :data:`BACKEND_NAME` backend (idempotent): ``init_process_group`` and
    ``new_group`` with it return a :class:`ResilientProcessGroup` with no communicator yet."""
    global _registered
    if _registered:
        return

    def create(opts: Any, _backend_options: Any) -> ResilientProcessGroup:
        # the job's backend is NCCL exactly when CUDA is here and not overridden: then CUDA
        # tensors get a group of their own each generation (the job's device is the GPU)
        dev = "nccl" if default_backend() == "nccl" else None
        # the default group is created with no member list: it is every rank
        members = list(opts.global_ranks_in_group)
        if not members:
            return ResilientProcessGroup(
                opts.group_rank,
                opts.group_size,
                range(opts.group_size),
                opts.timeout,
                key="world",
                device_backend=dev,
            )
        return ResilientProcessGroup(
            opts.group_rank, opts.group_size, members, clamp_timeout(opts.timeout), device_backend=dev
        )

    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=devices)
    _registered = True
