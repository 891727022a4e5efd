"""Pipeline parallel (``torch.distributed.pipelining``): which ranks hold the same stage, and a
schedule's restart after an abandoned step.

A pipeline stage's parameters are plain tensors, so the tracked modules say nothing of the mesh
(tensor parallel is learnt from DTensor placements, script_mesh.py). The script tracks its
schedule instead (``job.track(..., schedule=schedule)``); its stages name the pipeline group.
On a ``("dp", "pp")`` mesh, ``init_device_mesh``'s row-major layout puts the stages of replica
i on ranks ``i*P .. i*P + P - 1``: the state of rank r is pipeline coordinate ``r % P`` in replica
``r // P``, and a replacement takes it from the rank of the same pipeline coordinate in another
replica (comm/mesh_coords.py's rule with "pp" as the split dimension).

A schedule prepares itself on its first ``step()``: a warm-up vote sent from stage to stage,
metadata for the receive buffers, the buffers themselves. A replacement starts with a fresh
schedule and so runs that preparation in its first step; its neighbours, prepared long ago,
would never answer, and a receive would wait for ever. :func:`restart_schedule`, run on every
rank as a step is abandoned, marks the schedule unprepared again, so that every stage prepares
afresh in the replayed step: the same messages on every rank, new receive buffers (nothing
that an aborted receive half-filled is read again). torch forks the RNG around that
preparation, so a replay stays bitwise the fault-free run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from checkpointless.comm.mesh_coords import MeshLayout
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger

__all__ = [
    "PIPELINE_DIMS",
    "is_schedule",
    "pipeline_groups",
    "pipeline_layout",
    "restart_schedule",
    "schedule_stages",
    "schedules_layout",
    "warn_if_untracked",
    "with_pipeline_dim",
]

log = get_logger()

PIPELINE_DIMS = ("dp", "pp")  # the names the layout gives a pipeline job's two dimensions


def _schedules() -> Any:
    # never imported here: a job that does not use pipelining must not pay for its import
    return sys.modules.get("torch.distributed.pipelining.schedules")


def is_schedule(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.distributed.pipelining`` schedule (single- or multi-stage)."""
    mod = _schedules()
    return mod is not None and isinstance(obj, mod.PipelineScheduleSingle | mod.PipelineScheduleMulti)


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a schedule runs on this rank (one, or several for interleaved schedules)."""
    # torch 2.13 keeps them in private attributes, with no public accessor
    if isinstance(schedule, _schedules().PipelineScheduleMulti):
        return list(schedule._stages)
    return [schedule._stage]


def restart_schedule(schedule: Any) -> None:
    """Mark ``schedule`` unprepared: its next ``step()`` runs the warm-up vote and the metadata
    exchange again and makes new receive buffers, on every rank alike (see the module's doc)."""
    for stage in schedule_stages(schedule):
        stage.clear_runtime_states()  # the forward cache, the outputs, the input buffers' grads
        # what backward keeps per microbatch until its send (popped by index, never cleared)
        stage.bwd_cache.clear()
        stage.backward_state.clear()
    # the last stage's microbatch losses: the replay's losses are appended after these, and
    # backward would take microbatch 0's loss of the abandoned attempt (its graph freed already)
    schedule._internal_losses.clear()
    for pending in ("fwd_recv_ops", "bwd_recv_ops"):  # a runtime schedule's receives in flight
        ops = getattr(schedule, pending, None)
        if isinstance(ops, dict):
            ops.clear()
    # the flags that torch 2.13's schedules test before preparing; no public way to reset them
    if isinstance(schedule, _schedules().PipelineScheduleMulti):
        schedule._stages_forward_initialized = False
        schedule._stages_backward_initialized = False
    else:
        schedule._stage_forward_initialized = False
        schedule._stage_backward_initialized = False


def pipeline_groups(schedules: Sequence[Any]) -> list[Any]:
    """The distinct process groups of the schedules' stages.

    Raises:
        ConfigError: the stages run on different groups."""
    groups: list[Any] = []
    for schedule in schedules:
        for stage in schedule_stages(schedule):
            group = stage.group if stage.group is not None else dist.group.WORLD
            if all(group is not g for g in groups):
                groups.append(group)
    if len(groups) > 1:
        raise ConfigError(
            "the tracked pipeline schedules run on different process groups; recovery by "
            "coordinates needs one pipeline group per rank (mesh['pp'].get_group())"
        )
    return groups


def pipeline_layout(group_ranks: Sequence[int], rank: int, world_size: int) -> MeshLayout:
    """The ``("dp", "pp")`` layout in which ``group_ranks`` (this rank's pipeline group, in
    group-rank order) is the pipeline line of ``rank``. Pure, so every rank and the tests agree.

    Raises:
        ConfigError: the pipeline groups are not consecutive blocks of ranks (the pipeline
            dimension is not the mesh's last), or do not divide the job."""
    p = len(group_ranks)
    if p < 1 or world_size % p:
        raise ConfigError(f"a pipeline group of {p} ranks does not divide a job of {world_size} ranks")
    first = rank - rank % p
    if list(group_ranks) != list(range(first, first + p)):
        raise ConfigError(
            f"rank {rank}'s pipeline group is ranks {list(group_ranks)}; recovery by coordinates "
            f"needs consecutive ranks {list(range(first, first + p))}: put the pipeline dimension "
            "last, e.g. init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp'))"
        )
    return MeshLayout.of(PIPELINE_DIMS, (world_size // p, p), sharded={"pp"})


def schedules_layout(schedules: Sequence[Any], rank: int, world_size: int) -> MeshLayout:
    """The ``("dp", "pp")`` layout of a job whose tracked ``schedules`` run on this rank's
    pipeline group (read from the group's global ranks).

    Raises:
        ConfigError: as :func:`pipeline_groups` and :func:`pipeline_layout`."""
    (group,) = pipeline_groups(schedules)
    return pipeline_layout(dist.get_process_group_ranks(group), rank, world_size)


def with_pipeline_dim(layout: MeshLayout, device_mesh: Any, schedules: Sequence[Any]) -> MeshLayout:
    """``layout`` (a mesh learnt from DTensor placements: tensor parallel) with the dimension
    whose group the pipeline stages run on counted as split too: dp x pp x tp.

    Raises:
        ConfigError: the pipeline group is none of the mesh's dimensions' groups."""
    (group,) = pipeline_groups(schedules)
    for name in layout.names:
        if device_mesh.get_group(name) is group:
            split = {n for n in layout.names if n not in layout.replicate} | {name}
            return MeshLayout.of(layout.names, layout.shape, split)
    raise ConfigError(
        f"the pipeline stages' group is none of the groups of the mesh {layout.names}; make it "
        "with mesh['pp'].get_group() on the mesh of the tracked DTensors"
    )


def warn_if_untracked() -> None:
    """As ``job.steps()`` begins with no mesh and no tracked schedule: a script that imported
    ``torch.distributed.pipelining`` most likely forgot ``schedule=``, and every rank would then
    be taken for a replica of rank 0 (its stage's state copied onto every rank)."""
    if _schedules() is not None:
        log.warning(
            "torch.distributed.pipelining is imported but no pipeline schedule is tracked: the job "
            "takes every rank for a replica of rank 0; for pipeline stages pass the schedule, "
            "job.track(..., schedule=schedule) (docs/adoption.md, Pipeline parallel)"
        )
