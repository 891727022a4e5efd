"""Sharded jobs (FSDP2, HSDP): the mesh a job carries through recoveries, and a shard's replica.

``job.device_mesh(("replicate", "shard"), (R, S))`` builds a :class:`ShardedRun`: a
``DeviceMesh`` over :class:`~checkpointless.comm.process_group.ResilientProcessGroup` objects
(comm/mesh.py) that the script hands to torch's own ``fully_shard``. The job drives it through
each recovery next to its data-parallel communicator: :meth:`ShardedRun.abort` with
``Communicator.abort``, :meth:`ShardedRun.configure` from the same store as
``Communicator.rebuild``, :meth:`ShardedRun.reset` (FSDP2's leftovers) before the replay, and
:meth:`ShardedRun.release` once the generation has formed.

What a rank's replica is, on a mesh: the *local* shards of its DTensors. :class:`LocalModuleState`
and :class:`LocalOptimizerState` stand in for a module and an optimizer whose tensors are
DTensors: their ``state_dict`` gives each DTensor's ``to_local()`` (the very storage FSDP2
computes with, so a transfer lands in place), and ``load_state_dict`` puts local tensors back
(for the optimizer, wrapped as DTensors laid out like their parameter). :class:`ShardIdentity`
travels with the state and refuses a shard of another coordinate: a plan bug can never
leave a rank training on somebody else's shard.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from checkpointless.comm.communicator import Communicator
from checkpointless.comm.mesh import ResilientMesh, make_device_mesh, reset_fsdp
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.errors import CommAborted, ConfigError, StateTransferError
from checkpointless.protocol import ResumePlan
from checkpointless.state.buddy import BuddyCopies, copy_channel
from checkpointless.state.snapshot import Stateful
from checkpointless.state.stream import StreamRoute
from checkpointless.state.transfer import send_state

__all__ = [
    "SHARD_STATE_NAME",
    "CopySender",
    "LocalModuleState",
    "LocalOptimizerState",
    "ShardIdentity",
    "ShardedRun",
    "buddies_wanted",
    "has_dtensors",
    "local_stateful",
    "mesh_shape_error",
    "send_copies",
]

SHARD_STATE_NAME = "__shard__"  # the registered name of the ShardIdentity


class ShardedRun:
    """A job's (replicate, shard) mesh over resilient groups, and this rank's place in it.

    A 1-D mesh (``("shard",), (S,)``) is plain FSDP: one replica group, ``R = 1``. Ranks are
    laid out row-major, so rank r holds shard coordinate ``r % S`` in replica group ``r // S``.

    ``mesh``: a mesh made already (:meth:`adopt`: the script's own ``init_device_mesh``, e.g.
    dp x tp, described by its (R, S) as comm/mesh_coords.py computes it); otherwise one is made
    over ``names`` and ``shape``.
    """

    def __init__(
        self,
        names: Sequence[str],
        shape: Sequence[int],
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        on_collective: Callable[[str], None] | None = None,
        device_type: str = "cpu",
        mesh: ResilientMesh | None = None,
        world_formed_elsewhere: bool = False,
    ) -> None:
        dims = tuple(int(n) for n in shape)
        # the mesh's world group is torch's default group, which the job forms in every
        # generation already (recovery/default_group.py): the mesh forms only its own groups
        self.world_formed_elsewhere = world_formed_elsewhere
        # c10d's bookkeeping needs a store object but sends nothing over it (comm/mesh.py); each
        # generation's communicators form from the store given to configure()
        self.mesh: ResilientMesh = (
            mesh
            if mesh is not None
            else make_device_mesh(names, dims, rank, world_size, dist.HashStore(), timeout, device_type)
        )
        self.replicate, self.shards = (1, dims[0]) if len(dims) == 1 else (dims[0], dims[1])
        self.rank = rank
        for pg in self.mesh.groups:
            pg.before_collective = on_collective

    @classmethod
    def adopt(
        cls, device_mesh: Any, world: ResilientProcessGroup, plan_shape: tuple[int, int], rank: int
    ) -> ShardedRun:
        """The job's view of a mesh the script made itself: its (R, S) and this rank's coordinate;
        the mesh's groups stay the script groups' to drive (ResilientMesh.adopted)."""
        mesh = ResilientMesh.adopted(device_mesh, world)
        world_size = plan_shape[0] * plan_shape[1]
        # the timeout is only a new mesh's (its groups'); this one's groups have theirs
        unused = datetime.timedelta(seconds=60)
        return cls(("replicate", "shard"), plan_shape, rank, world_size, unused, mesh=mesh)

    @property
    def device_mesh(self) -> Any:
        return self.mesh.device_mesh

    @property
    def shape(self) -> tuple[int, int]:
        """(replicate, shard) sizes, as the recovery plan learns them."""
        return (self.replicate, self.shards)

    @property
    def coordinate(self) -> tuple[int, int]:
        """(replica group, shard) of this rank."""
        return (self.rank // self.shards, self.rank % self.shards)

    def abort(self, reason: str) -> int:
        return self.mesh.abort(reason)

    def aborted(self) -> str | None:
        """Why a group of the mesh was aborted, or None while every group is live."""
        for pg in self.mesh.formed_groups:
            if pg.aborted is not None:
                return f"mesh group {pg.key} aborted: {pg.aborted}"
        return None

    def check(self) -> None:
        """Raise CommAborted if any group was aborted: an update must not follow a dead step."""
        for pg in self.mesh.formed_groups:
            if pg.aborted is not None:
                raise CommAborted(f"mesh group {pg.key} aborted: {pg.aborted}")

    def configure(
        self,
        generation: int,
        store: dist.Store,
        deadline: float,
        cancelled: threading.Event | None,
        formed: Collection[ResilientProcessGroup] = (),
    ) -> None:
        if self.world_formed_elsewhere:
            formed = (*formed, self.mesh.world)
        # a prefix of our own: the data-parallel communicator forms from the same store
        self.mesh.configure(generation, dist.PrefixStore("mesh/", store), deadline, cancelled, formed)

    def reset(self, modules: Sequence[nn.Module]) -> None:
        for m in modules:
            reset_fsdp(m)

    def release(self) -> None:
        self.mesh.release_graveyard()

    def identity(self) -> ShardIdentity:
        return ShardIdentity(self.shape, self.coordinate[1])


class ShardIdentity:
    """Travels with a rank's state: which shard coordinate of which mesh it is."""

    def __init__(self, shape: tuple[int, int], shard: int) -> None:
        self.shape = shape
        self.shard = shard

    def state_dict(self) -> dict[str, int]:
        return {"replicate": self.shape[0], "shards": self.shape[1], "shard": self.shard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        got = (int(state["replicate"]), int(state["shards"]), int(state["shard"]))
        want = (*self.shape, self.shard)
        if got != want:
            raise StateTransferError(
                f"received the state of shard {got[2]} of a {got[0]}x{got[1]} mesh; this rank holds "
                f"shard {want[2]} of a {want[0]}x{want[1]} mesh (a wrong source in the plan)"
            )


def has_dtensors(obj: object) -> bool:
    """Whether a module's parameters or an optimizer's parameters are DTensors (fully_shard)."""
    if isinstance(obj, nn.Module):
        return any(isinstance(p, DTensor) for p in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for g in obj.param_groups for p in g["params"])
    return False


def local_stateful(obj: Stateful) -> Stateful:
    """The object to register for ``obj``: a local-shard view when it holds DTensors."""
    if isinstance(obj, nn.Module) and has_dtensors(obj):
        return LocalModuleState(obj)
    if isinstance(obj, torch.optim.Optimizer) and has_dtensors(obj):
        return LocalOptimizerState(obj)
    return obj


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


# FSDP2's own state-dict pre-hook (it only makes sure the sharded parameters are registered)
_FSDP_HOOK = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"


def _plain_state_dict(module: nn.Module) -> bool:
    """Whether ``module``'s state dict is exactly its parameters and persistent buffers: no
    state-dict hook but FSDP2's own, no ``_save_to_state_dict`` or ``get_extra_state`` of its own."""
    for m in module.modules():
        cls = type(m)
        if (
            m._state_dict_hooks
            or any(getattr(h, "__qualname__", "") != _FSDP_HOOK for h in m._state_dict_pre_hooks.values())
            or cls._save_to_state_dict is not nn.Module._save_to_state_dict
            or cls.get_extra_state is not nn.Module.get_extra_state
        ):
            return False
    return True


class LocalModuleState:
    """A sharded module's replica: its parameters' and buffers' local shards, by name.

    Why remembered: the state is taken as every step begins (buddy copies, snapshots), and an
    FSDP2 module's ``state_dict()`` walks every submodule and dispatches a DTensor detach per
    parameter, ~0.8 ms of the training thread for a 4-layer model. Its result is a view of each
    parameter's and buffer's local memory, so it stays right for as long as the module holds the
    same tensor objects over the same memory: the remembered dict is reused while that
    fingerprint (each tensor's identity and address, ~0.2 ms to take) is unchanged, and only for
    modules whose state dict is nothing but those tensors (:func:`_plain_state_dict`)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._memo: tuple[tuple[tuple[int, int], ...], dict[str, torch.Tensor]] | None = None

    def _fingerprint(self) -> tuple[tuple[int, int], ...] | None:
        if not _plain_state_dict(self.module):
            return None
        with torch.no_grad():
            params = [(id(p), _local(p).data_ptr()) for p in self.module.parameters()]
        return (*params, *((id(b), b.data_ptr()) for b in self.module.buffers()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        fp = self._fingerprint()
        if fp is not None and self._memo is not None and self._memo[0] == fp:
            return dict(self._memo[1])
        with torch.no_grad():
            sd = {k: _local(v) for k, v in self.module.state_dict().items()}
        # taken again after state_dict(): FSDP2's hook may have registered the sharded parameters
        fp = self._fingerprint()
        self._memo = (fp, sd) if fp is not None else None
        return dict(sd)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = self.state_dict()
        if set(mine) != set(state):
            raise StateTransferError(
                f"sharded module state differs: missing {sorted(set(mine) - set(state))}, "
                f"unexpected {sorted(set(state) - set(mine))}"
            )
        with torch.no_grad():
            for k, dst in mine.items():
                src = state[k]
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise StateTransferError(
                        f"shard {k!r}: received {tuple(src.shape)} {src.dtype}, this rank holds "
                        f"{tuple(dst.shape)} {dst.dtype}"
                    )
                if src.data_ptr() != dst.data_ptr():  # landed in place already: nothing to copy
                    dst.copy_(src)


class LocalOptimizerState:
    """A sharded optimizer's replica: its state with every DTensor replaced by its local shard.

    Loading wraps each local tensor back into a DTensor laid out like its parameter (mesh,
    placements, global shape), which is what the optimizer's step expects; scalar entries (AdamW's
    ``step``) are plain tensors in FSDP2 and stay so.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        with torch.no_grad():  # to_local() is then the shard itself, not an autograd view of it
            state = {i: {k: _local(v) for k, v in s.items()} for i, s in sd["state"].items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state: dict[Any, dict[str, Any]] = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            state[i] = {k: _like(v, p, k) for k, v in s.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _like(v: Any, p: torch.Tensor, key: str) -> Any:
    if not isinstance(p, DTensor) or not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v
    local = p.to_local()
    if v.shape != local.shape:
        raise StateTransferError(
            f"optimizer state {key!r}: received a {tuple(v.shape)} shard, the parameter's is "
            f"{tuple(local.shape)}"
        )
    return DTensor.from_local(
        v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def mesh_shape_error(names: Sequence[str], shape: Sequence[int], world_size: int) -> ConfigError | None:
    """A clear error for a mesh that cannot be a job's, or None."""
    dims = tuple(shape)
    if len(dims) not in (1, 2) or len(tuple(names)) != len(dims):
        return ConfigError(
            f"job.device_mesh({tuple(names)}, {dims}): give ('replicate', 'shard') with (R, S), or "
            "('shard',) with (S,)"
        )
    product = 1
    for n in dims:
        product *= int(n)
    if product != world_size or any(int(n) < 1 for n in dims):
        return ConfigError(
            f"job.device_mesh: shape {dims} covers {product} ranks but the job has {world_size}; "
            "choose sizes whose product is the number of ranks (--nproc)"
        )
    return None


def buddies_wanted(mode: str, shape: tuple[int, int]) -> bool:
    """``--buddy-copies``: auto means on when a shard has no replica (R = 1) and S > 1."""
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"--buddy-copies must be auto, on or off (got {mode!r})")
    replicate, shards = shape
    if shards <= 1 or mode == "off":
        return False
    return mode == "on" or replicate == 1


class CopySender:
    """Sends the buddy copies a recovery plan asks of this rank, on a thread of its own, so that a
    keeper that must also receive (it rolls back itself) does both at once: two keepers that
    hold each other's copies would otherwise wait on each other."""

    def __init__(self, jobs: list[tuple[int, Any, StreamRoute]], comm: Communicator, timeout: float) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(jobs, comm, timeout), name="cl-buddy-return", daemon=True
        )
        self._thread.start()

    def _run(self, jobs: list[tuple[int, Any, StreamRoute]], comm: Communicator, timeout: float) -> None:
        try:
            for receiver, tree, route in jobs:
                send_state(comm, tree, [receiver], timeout, route)
        except BaseException as e:
            self.error = e

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.error = StateTransferError(f"sending buddy copies took over {timeout:.0f} s")


def send_copies(
    buddies: BuddyCopies,
    comm: Communicator,
    plan: ResumePlan,
    rank: int,
    generation: int,
    target: int,
    route: StreamRoute,
    timeout: float,
) -> CopySender | None:
    """Start sending the copies this rank keeps to the receivers the plan names (None: none)."""
    from_copy = set(plan.from_copy)
    jobs = [
        (r, buddies.copy(r, target), _replace_channel(route, copy_channel(generation, r)))
        for r, src in plan.sources
        if src == rank and r in from_copy
    ]
    return CopySender(jobs, comm, timeout) if jobs else None


def _replace_channel(route: StreamRoute, channel: str) -> StreamRoute:
    return StreamRoute(route.server, route.peers, route.secret, channel)
