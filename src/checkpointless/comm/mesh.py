"""A DeviceMesh whose process groups survive a recovery, and FSDP2's reset after an abort.

:func:`make_device_mesh` builds a ``DeviceMesh`` (for ``fully_shard``: 1-D for FSDP,
``("replicate", "shard")`` for HSDP) over :class:`ResilientProcessGroup` objects, one per line
of the mesh along each dimension, plus the default (world) group that ``DeviceMesh`` asks for
the global rank. :meth:`ResilientMesh.configure` gives every one of them the next generation's
gloo communicator; FSDP2's parameter groups, DTensors and the mesh keep the same objects.

:func:`reset_fsdp` forgets what an abandoned forward or backward left in FSDP2's state.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from checkpointless.comm.c10d_backend import BACKEND_NAME, register_backend
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.comm.script_groups import made_by_mesh
from checkpointless.errors import ConfigError

__all__ = ["ResilientMesh", "hold_replica_reduce", "make_device_mesh", "mesh_lines", "reset_fsdp"]


def mesh_lines(shape: Sequence[int]) -> list[list[list[int]]]:
    """For each mesh dimension, the groups of global ranks along it, in a fixed order.

    Ranks are laid out row-major over ``shape`` (as ``init_device_mesh`` does). For shape
    (2, 2): dimension 0 (replicate) has groups [0, 2] and [1, 3]; dimension 1 (shard) has
    [0, 1] and [2, 3]. Pure, so every rank and every generation agrees on it."""
    mesh = torch.arange(_product(shape)).view(*shape)
    out: list[list[list[int]]] = []
    for d, n in enumerate(shape):
        rows = mesh.movedim(d, -1).reshape(-1, n)
        out.append([[int(x) for x in row] for row in rows])
    return out


def _product(shape: Sequence[int]) -> int:
    p = 1
    for n in shape:
        p *= n
    return p


@dataclass
class ResilientMesh:
    """The mesh and the groups under it. ``groups`` is in configure order: the world group,
    then this rank's group along each mesh dimension; empty for a mesh the script made itself
    (:meth:`adopted`), whose groups the job's script groups drive."""

    device_mesh: DeviceMesh
    world: ResilientProcessGroup
    dim_groups: list[ResilientProcessGroup]
    generation: int = -1
    owns_groups: bool = True
    groups: list[ResilientProcessGroup] = field(init=False)

    def __post_init__(self) -> None:
        self.groups = [self.world, *self.dim_groups] if self.owns_groups else []

    @classmethod
    def adopted(cls, device_mesh: DeviceMesh, world: ResilientProcessGroup) -> ResilientMesh:
        """A mesh that ``init_device_mesh`` made (its groups came from ``dist.new_group`` on the
        job's default group, comm/script_groups.py, which forms, aborts and releases them in
        every generation): configuring, aborting or releasing it here touches no group, so
        nothing is formed twice."""
        return cls(device_mesh=device_mesh, world=world, dim_groups=[], owns_groups=False)

    def configure(
        self,
        generation: int,
        store: dist.Store,
        deadline: float,
        cancelled: threading.Event | None = None,
        formed: Collection[ResilientProcessGroup] = (),
    ) -> None:
        """Form every group's communicator of ``generation`` under the store prefix
        ``gen<generation>/`` (blocks until all members joined or ``deadline``, a
        ``time.monotonic()`` value). Every rank configures its groups in the same global order
        (world, then dimension 0's groups, then dimension 1's), so no two ranks wait on each
        other crosswise. Groups in ``formed`` already have this generation's communicator
        (the default group under plain torchrun) and are left as they are; every rank must
        pass the same ones."""
        gen_store = dist.PrefixStore(f"gen{generation}/", store)
        for pg in self.groups:
            if pg in formed or pg.folded:  # a folded group has no other process to form with
                continue
            pg.configure(generation, gen_store, deadline, cancelled)
        self.generation = generation

    @property
    def formed_groups(self) -> list[ResilientProcessGroup]:
        """The groups that form in each generation: a folded one has no communicator to watch."""
        return [pg for pg in self.groups if not pg.folded]

    def fold_replicas(self, folded: bool) -> None:
        """Degraded HSDP (comm/folded.py): this process holds every member of its replicate
        group (``folded``), or no longer does. Set before :meth:`configure`, which forms no
        communicator for a folded group; every process of the mesh must agree on it. A mesh the
        script made (:meth:`adopted`) drives no group: its groups are the script's, folded with
        them (ScriptGroups.fold)."""
        if not self.owns_groups:
            return
        if len(self.dim_groups) != 2:
            raise ConfigError(
                f"degraded mode cannot go on: job.device_mesh() made a mesh of "
                f"{len(self.dim_groups)} dimension(s); of its meshes only the 2-D ('replicate', "
                "'shard') one can drop a replica group (make a 3-D mesh with init_device_mesh after "
                "checkpointless.init()). Keep a spare ready (--spares) or run with --when-no-spare fail"
            )
        self.dim_groups[0].folded = folded

    def abort(self, reason: str) -> int:
        """Abort every group (thread-safe); return how many collectives were pending."""
        return sum(pg.abort(reason) for pg in self.groups)

    def release_graveyard(self) -> None:
        for pg in self.groups:
            pg.release_graveyard()


def make_device_mesh(
    mesh_dim_names: Sequence[str],
    shape: Sequence[int],
    rank: int,
    world_size: int,
    store: dist.Store,
    timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    device_type: str = "cpu",
) -> ResilientMesh:
    """Build the mesh; its groups have no communicator until :meth:`ResilientMesh.configure`.

    ``store`` is only handed to c10d's bookkeeping here (no traffic); each generation's
    communicators form from the store given to ``configure``. If the default group is not yet
    initialised it becomes a :class:`ResilientProcessGroup` of all ranks. Every rank must call
    this with the same arguments (but its own ``rank``), like ``init_device_mesh``.
    ``device_type`` is where FSDP2 puts the shards: "cuda" for a job on GPUs (NCCL).
    """
    names, dims = tuple(mesh_dim_names), tuple(int(n) for n in shape)
    if len(names) != len(dims) or not 1 <= len(dims) <= 2 or len(set(names)) != len(names):
        raise ConfigError(
            f"make_device_mesh: mesh_dim_names {names} and shape {dims} must be one or two "
            "distinct names with one size each, e.g. ('replicate', 'shard') and (2, 2)"
        )
    if any(n < 1 for n in dims) or _product(dims) != world_size:
        raise ConfigError(
            f"make_device_mesh: shape {dims} does not cover world_size {world_size}; "
            "the product of the sizes must equal the number of ranks"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"make_device_mesh: rank {rank} is outside 0..{world_size - 1}")
    register_backend()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=BACKEND_NAME, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    world = dist.distributed_c10d._get_default_group()
    if not isinstance(world, ResilientProcessGroup):
        raise ConfigError(
            f"make_device_mesh: the default process group is {type(world).__name__}, not ours; "
            "call make_device_mesh before (instead of) dist.init_process_group"
        )
    mine: list[ResilientProcessGroup] = []
    # the job's default group is handed these new_group calls as it is the script's
    # (script_groups.py); made here, they are the mesh's, and configure() below drives them
    with made_by_mesh():
        for lines in mesh_lines(dims):
            for members in lines:
                # every rank creates every group, in the same order, as c10d requires
                pg = dist.new_group(members, backend=BACKEND_NAME, timeout=timeout)
                if rank in members:
                    assert isinstance(pg, ResilientProcessGroup)
                    mine.append(pg)
    mesh_t = torch.arange(world_size, dtype=torch.int).view(*dims)
    if len(dims) == 1:
        dm = DeviceMesh.from_group(mine[0], device_type, mesh_dim_names=names)
    else:
        dm = DeviceMesh.from_group(mine, device_type, mesh=mesh_t, mesh_dim_names=names)
    return ResilientMesh(device_mesh=dm, world=world, dim_groups=mine)


def hold_replica_reduce(module: nn.Module, last_pass: bool) -> None:
    """Degraded HSDP: before each pass of a step, whether its backward all-reduces over the
    replicate group. Every pass but the last keeps its reduce-scattered gradient inside FSDP2,
    which adds it to the last pass's before that pass's single all-reduce (comm/folded.py says
    why the sum is then the full-width job's, bit for bit). At full width: ``last_pass`` True."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_all_reduce(last_pass, recurse=False)


def reset_fsdp(module: nn.Module) -> None:
    """Forget an abandoned forward or backward in every FSDP2 module under ``module``, so that
    the step can be replayed from the start (after :meth:`ResilientMesh.configure`).

    What an abort leaves behind, and why each part is cleared (torch 2.13's FSDP2; 2.11's too):

    - a parameter group's pending all-gather result (``_all_gather_result``) holds the aborted
      work; waiting on it again would raise, so it is dropped, not waited;
    - parameters may be left unsharded (all-gathered, or half-way): ``_to_sharded`` frees the
      unsharded storage and puts the sharded DTensors back on the module;
    - training states stuck in FORWARD / PRE_BACKWARD, prefetch indices and the root's
      ``post_backward_final_callback_queued`` flag: the final callback never ran, and with
      the flag set FSDP2 would never queue it again, so gradients would not be finished;
    - the shared comm context's retained reduce-scatter states, post-reduce events and forward
      order;
    - gradients: reduce-scatters that completed before the abort left sharded gradients, and
      unsharded parameters may hold gradients computed before the abort that no reduce-scatter
      took yet; the replay would add to both, so every one of them is set to None.

    On a GPU, every CUDA event that a dropped state holds is waited on first by the current
    stream (and a reshard's by the all-gather streams), as torch 2.13's own
    ``FSDPState._reset_iter_state`` does: the buffers of a collective's state were allocated on
    the compute stream, and without the wait the compute stream could reuse them while a
    collective's stream still reads them. Waiting on an event is not waiting on the aborted
    work: NCCL's abort has ended its kernels, so the events complete.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        ctx = state._state_ctx
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False
        state._training_state = TrainingState.IDLE
        state._modules_to_run_forward.clear()
        comm = state._comm_ctx
        if hasattr(comm, "post_forward_order"):  # set up by FSDP2's lazy init (first forward)
            _stream_waits(getattr(comm.all_gather_state, "event", None))
            comm.all_gather_state = None
            comm.post_forward_order.clear()
            if hasattr(comm, "reduce_scatter_states"):
                _stream_waits(*(st.event for st in comm.reduce_scatter_states))
                comm.reduce_scatter_states.clear()
            else:  # torch 2.11 retains one reduce-scatter state, not a list
                _stream_waits(getattr(comm.reduce_scatter_state, "event", None))
                comm.reduce_scatter_state = None
            last = getattr(comm, "_last_post_reduce_events", None)  # torch 2.13
            if last:
                _stream_waits(*last.values())
                last.clear()
        for group in _param_groups(state):
            _stream_waits(
                getattr(group._all_gather_result, "all_gather_event", None),
                group._post_reduce_event,
                getattr(group._all_reduce_state, "event", None),
            )
            if group._reshard_after_forward_event is not None:
                group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
            group._all_gather_result = None
            group._post_reduce_event = None
            group._all_reduce_state = None
            group._reshard_after_forward_event = None
            group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
            for fp in group.fsdp_params:
                fp.unsharded_accumulated_grad = None
                # backward computed this gradient but the abort came before its reduce-scatter
                # took it: the replay would add to it
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
    for p in module.parameters():
        p.grad = None


def _stream_waits(*events: Any) -> None:
    """Make the current CUDA stream wait for each of ``events`` that is a CUDA event (FSDP2 on a
    CPU mesh records none, or device-less ones that nothing needs to wait for)."""
    for ev in events:
        if isinstance(ev, torch.cuda.Event) or (isinstance(ev, torch.Event) and ev.device.type == "cuda"):
            ev.wait(torch.cuda.current_stream())


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list in torch 2.13, at most one before (2.11 is the
    torch of the lent GPU machine, where ``benchmarks/gpu_check.py`` runs; the package pins 2.13)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = state._fsdp_param_group
    return [] if one is None else [one]
