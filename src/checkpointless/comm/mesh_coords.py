"""Recovery by coordinates: on a device mesh, which ranks hold the same state.

A rank's state on a mesh is named by its coordinates on every dimension except the *replicate*
dimensions: the ones over which the state is the same (data-parallel replicas). On a (dp, tp)
mesh the state of rank (dp=i, tp=j) is tp shard j, held by every rank (dp=i', tp=j); a lost rank
takes it from one of those, never from another tp coordinate. HSDP's ("replicate", "shard") mesh
is the same rule with "shard" in the place of "tp".

The recovery plan (coordinator/rules/decisions.py) knows a mesh as (R, S): R replica groups of S
state coordinates, rank r holding coordinate ``r % S`` in replica group ``r // S``. That is this
module's rule exactly when the replicate dimensions lead the mesh (row-major, as
``init_device_mesh`` lays out ranks, and as torchtitan orders dp before tp); :meth:`MeshLayout.plan_shape`
says so or refuses the mesh. Everything here is pure, so every rank and the tests agree on it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from checkpointless.errors import ConfigError

__all__ = ["MeshLayout", "mesh_order_error"]


@dataclass(frozen=True)
class MeshLayout:
    """A mesh's dimension names and sizes (ranks row-major over them), and which dimensions the
    state is replicated over."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    replicate: frozenset[str]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shape) or len(set(self.names)) != len(self.names):
            raise ConfigError(f"mesh dimensions {self.names} and sizes {self.shape} do not match")
        if any(n < 1 for n in self.shape):
            raise ConfigError(f"mesh sizes must be positive: {self.shape}")
        unknown = sorted(self.replicate - set(self.names))
        if unknown:
            raise ConfigError(f"replicate dimensions {unknown} are not dimensions of the mesh {self.names}")

    @classmethod
    def of(cls, names: Sequence[str], shape: Sequence[int], sharded: Collection[str]) -> MeshLayout:
        """The layout whose state differs along the ``sharded`` dimensions (a DTensor is split
        along each of them) and is replicated along every other one."""
        return cls(tuple(names), tuple(int(n) for n in shape), frozenset(set(names) - set(sharded)))

    @property
    def world_size(self) -> int:
        p = 1
        for n in self.shape:
            p *= n
        return p

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate on every dimension (row-major, as ``init_device_mesh``)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        out: list[int] = []
        for n in reversed(self.shape):
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(reversed(out))

    def state_coordinates(self, rank: int) -> tuple[int, ...]:
        """What names ``rank``'s state: its coordinates on the dimensions that are not replicate."""
        return tuple(
            c
            for c, name in zip(self.coordinates(rank), self.names, strict=True)
            if name not in self.replicate
        )

    def holders(self, rank: int) -> list[int]:
        """The other ranks that hold ``rank``'s state (its replicas), lowest first: where a
        replacement for ``rank`` may take its state from."""
        mine = self.state_coordinates(rank)
        return [r for r in range(self.world_size) if r != rank and self.state_coordinates(r) == mine]

    def plan_shape(self) -> tuple[int, int]:
        """(R, S) for the recovery plan: R copies of each of S states, rank r holding state
        ``r % S``. Only a mesh whose replicate dimensions lead has that form.

        Raises:
            ConfigError: a replicate dimension comes after one the state is split over."""
        split = [i for i, name in enumerate(self.names) if name not in self.replicate]
        rep = [i for i, name in enumerate(self.names) if name in self.replicate]
        if split and rep and max(rep) > min(split):
            raise ConfigError(
                f"mesh {dict(zip(self.names, self.shape, strict=True))}: the state is replicated over "
                f"{sorted(self.replicate)} but split over {[self.names[i] for i in split]}, and a "
                "replicate dimension comes after a split one; put the replicate (data-parallel) "
                "dimensions first, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
            )
        replicas = 1
        for i in rep:
            replicas *= self.shape[i]
        return (replicas, self.world_size // replicas)


def mesh_order_error(mesh_ranks: Sequence[int], world_size: int) -> ConfigError | None:
    """A mesh whose ranks are not 0..world_size-1 in row-major order (``init_device_mesh``'s
    layout) cannot be named by (R, S): a clear error, or None."""
    if list(mesh_ranks) != list(range(world_size)):
        return ConfigError(
            f"the tracked DTensors' device mesh lays out ranks {list(mesh_ranks)}; recovery by "
            f"coordinates needs all {world_size} ranks of the job in order (init_device_mesh's layout)"
        )
    return None
