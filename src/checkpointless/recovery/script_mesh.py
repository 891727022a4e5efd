"""A mesh the script made itself (``init_device_mesh``, then ``parallelize_module`` for tensor
parallel, or ``fully_shard``), learned from the DTensors it tracks.

A script that calls torch's ``init_device_mesh`` after ``checkpointless.init()`` gets resilient
groups (comm/script_groups.py), but recovery must also know which ranks hold the same state:
without that, the job's first state sync would copy rank 0's tensor-parallel shard onto every
rank (the shapes agree, so nothing would notice) and a replacement would take another shard's
state. :func:`adopt_script_mesh` runs as ``job.steps()`` begins: it reads the placements of the
tracked modules' DTensors, calls a dimension *split* when some DTensor is sharded along it and
*replicate* otherwise (the data-parallel dimensions, over which the script keeps its replicas
equal), and makes the job's sharded run from that (comm/mesh_coords.py): rank (dp=i, tp=j) then
takes its state from a rank (dp=i', tp=j) and from no other. Every tracked optimizer over
DTensors, on this mesh or on ``job.device_mesh()``'s, settles ``Partial`` gradients before its
step (:func:`settle_before_update`, installed by ``job.track()``), so that an update never
communicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from checkpointless.comm.mesh_coords import MeshLayout, mesh_order_error
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.recovery.member import Member
from checkpointless.recovery.pipeline import schedules_layout, warn_if_untracked, with_pipeline_dim
from checkpointless.recovery.sharded import SHARD_STATE_NAME, ShardedRun
from checkpointless.recovery.startup import sharded_copies
from checkpointless.recovery.tp_hosts import warn_if_tp_spans_hosts

__all__ = ["ScriptMesh", "adopt_script_mesh", "script_mesh_of", "settle_before_update", "settle_gradients"]

log = get_logger()


@dataclass(frozen=True)
class ScriptMesh:
    """The root mesh that the tracked DTensors live on, and how their state is laid out on it."""

    device_mesh: Any  # torch's DeviceMesh (the root of every DTensor's mesh)
    ranks: tuple[int, ...]  # the root mesh's global ranks, row-major
    layout: MeshLayout


def _root(mesh: Any) -> Any:
    # torch 2.13 has no public accessor for a sub-mesh's parent (mesh["tp"] -> the dp x tp
    # mesh); a mesh that is nobody's sub-mesh is its own root
    return mesh._get_root_mesh()


def _names(mesh: Any) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    return tuple(names) if names is not None else tuple(f"dim{i}" for i in range(mesh.ndim))


def script_mesh_of(tensors: Iterable[torch.Tensor]) -> ScriptMesh | None:
    """The mesh of the DTensors among ``tensors`` and the dimensions their state is split along,
    or None when there is no DTensor.

    A sub-mesh's dimensions are named like its root's (``mesh["tp"]``); a dimension of a
    DTensor's mesh that the root does not have by name (a flattened mesh) counts every root
    dimension as split: then each rank's state is its own, which is never wrong (no replica is
    assumed), only less recoverable.

    Raises:
        ConfigError: the DTensors live on meshes of different roots."""
    root: Any = None
    split: set[str] = set()
    for t in tensors:
        if not isinstance(t, DTensor):
            continue
        mesh = t.device_mesh
        r = _root(mesh)
        if root is None:
            root = r
        elif r is not root:
            raise ConfigError(
                "the tracked DTensors live on different device meshes; recovery by coordinates "
                "needs one mesh (make the sub-meshes of one init_device_mesh)"
            )
        root_names = _names(root)
        for name, placement in zip(_names(mesh), t.placements, strict=True):
            if placement.is_replicate():
                continue
            split.update([name] if name in root_names else root_names)
    if root is None:
        return None
    ranks = tuple(int(x) for x in root.mesh.flatten().tolist())
    return ScriptMesh(root, ranks, MeshLayout.of(_names(root), tuple(root.mesh.shape), split))


def _tracked_tensors(modules: Iterable[nn.Module]) -> Iterable[torch.Tensor]:
    for m in modules:
        yield from m.parameters()
        yield from m.buffers()


def settle_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Give every DTensor gradient its parameter's placements now: a gradient left ``Partial``
    (a norm's under ``SequenceParallel``: each tp rank summed its own part of the sequence) is
    all-reduced here, which the optimizer's step would otherwise do inside the update. An update
    must communicate nothing: once every rank is past the update guard's barrier it is applied
    even if a fault aborts the groups meanwhile, and an all-reduce inside it would be cut off
    half-way, leaving the ranks of both replicas half-updated with no state left to recover."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)


def settle_before_update(optimizer: torch.optim.Optimizer) -> None:
    """Run :func:`settle_gradients` before every other step pre-hook (the update guard's barrier,
    registered by ``job.track``): its all-reduce is part of the step, abortable like the rest.
    ``job.track()`` installs it on every optimizer over DTensors, whoever made their mesh."""
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: settle_gradients(opt))
    optimizer._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)


def adopt_script_mesh(member: Member) -> None:
    """As ``job.steps()`` begins: when the tracked modules hold DTensors on a mesh that the job
    did not make (``job.device_mesh()`` made none), make the job's sharded run from it, so that
    the first state sync, the recovery plan, the shard-identity check, the divergence check and
    the per-rank copies all work per coordinate class."""
    if member.groups.mesh is not None or member.clock.started:
        return
    found = script_mesh_of(_tracked_tensors(member.tracked.modules))
    schedules = member.tracked.schedules  # pipeline parallel names its split dimension itself
    if found is not None and schedules:
        found = dataclasses.replace(
            found, layout=with_pipeline_dim(found.layout, found.device_mesh, schedules)
        )
    elif schedules:  # stages of plain tensors: no mesh object is needed, only the (dp, pp) layout
        layout = schedules_layout(schedules, member.rank, member.world_size)
        found = ScriptMesh(None, tuple(range(member.world_size)), layout)
    if found is None:
        warn_if_untracked()
        return
    err = mesh_order_error(found.ranks, member.world_size)
    if err is not None:
        raise err
    plan_shape = found.layout.plan_shape()
    world = dist.distributed_c10d._get_default_group()
    if not isinstance(world, ResilientProcessGroup):
        raise ConfigError(
            "the tracked DTensors' mesh was made over a default group that is not the job's; call "
            "init_device_mesh after checkpointless.init(), not after dist.init_process_group"
        )
    mesh = member.groups.mesh = ShardedRun.adopt(found.device_mesh, world, plan_shape, member.rank)
    member.tracked.objects[SHARD_STATE_NAME] = mesh.identity()
    if mesh.shards > 1:
        sharded_copies(member)
    layout = found.layout
    warn_if_tp_spans_hosts(member, layout)
    log.info(
        "mesh %s: state split over %s, replicated over %s; rank %d holds state %s, also held by ranks %s",
        dict(zip(layout.names, layout.shape, strict=True)),
        [n for n in layout.names if n not in layout.replicate],
        sorted(layout.replicate),
        member.rank,
        layout.state_coordinates(member.rank),
        layout.holders(member.rank),
    )
