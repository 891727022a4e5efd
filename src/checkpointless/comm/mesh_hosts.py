"""Which hosts a mesh's tensor-parallel groups sit on, under the job's host-major placement.

Tensor parallel talks in every layer's forward and backward, so its groups belong inside a host
(NVLink, shared memory), and the replicas across hosts. The launcher places ranks host-major
(coordinator/rules/placement.py: rank ``r`` on node ``r // P``, ``P = --nproc-per-node``) and a
mesh lays its ranks out row-major (``init_device_mesh``), so a TP group stays on one host exactly
when "tp" is the mesh's last dimension and its size divides ``P``. Nothing else stops a job from
running with its TP groups split over hosts, only slower: :func:`spanning_groups` finds them, and
:func:`spanning_warning` says so with the fix (recovery/mesh_warnings.py emits it). Pure: every
rank and the tests agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointless.comm.mesh_coords import MeshLayout

__all__ = ["TP_DIMS", "SpanningGroup", "group_ranks", "spanning_groups", "spanning_warning"]

# the dimension names taken for tensor parallel (torchtitan's and torch's examples say "tp")
TP_DIMS = ("tp",)


@dataclass(frozen=True)
class SpanningGroup:
    """A group along mesh dimension ``dim`` whose ``ranks`` sit on more than one host
    (``hosts``: their node ranks, in the order of the ranks' first appearance)."""

    dim: str
    ranks: tuple[int, ...]
    hosts: tuple[int, ...]


def group_ranks(layout: MeshLayout, dim: str) -> list[tuple[int, ...]]:
    """The groups along ``dim``: the ranks that differ only in their ``dim`` coordinate, each
    group in coordinate order, the groups by their lowest rank."""
    if dim not in layout.names:
        return []
    i = layout.names.index(dim)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        groups.setdefault(c[:i] + c[i + 1 :], []).append(rank)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


def spanning_groups(
    layout: MeshLayout, per_host: int, dims: tuple[str, ...] = TP_DIMS
) -> list[SpanningGroup]:
    """The groups along each of ``dims`` that span hosts, ``per_host`` ranks to a host
    (host-major), in rank order; empty when every group is on one host or there is none."""
    if per_host < 1:
        raise ValueError(f"per_host must be a positive number of ranks (got {per_host})")
    out: list[SpanningGroup] = []
    for dim in dims:
        for ranks in group_ranks(layout, dim):
            hosts = tuple(dict.fromkeys(r // per_host for r in ranks))
            if len(hosts) > 1:
                out.append(SpanningGroup(dim, ranks, hosts))
    return out


def _fix(layout: MeshLayout, dim: str, per_host: int) -> str:
    size = layout.shape[layout.names.index(dim)]
    if layout.names[-1] != dim:
        order = (*(n for n in layout.names if n != dim), dim)
        return (
            f"make {dim!r} the mesh's last dimension, e.g. init_device_mesh(device, shape, "
            f"mesh_dim_names={order}) with the shape in that order"
        )
    return (
        f"make --nproc-per-node a multiple of the {dim} size {size} (it is {per_host}), or the {dim} "
        f"size a divisor of it"
    )


def spanning_warning(layout: MeshLayout, per_host: int, spans: list[SpanningGroup]) -> str:
    """The human line for ``spans`` (not empty): the mesh, the first group's ranks and hosts, how
    many groups span hosts, and the fix."""
    first = spans[0]
    mesh = dict(zip(layout.names, layout.shape, strict=True))
    more = f" (and {len(spans) - 1} more of its groups)" if len(spans) > 1 else ""
    return (
        f"tensor-parallel group {first.dim!r} of mesh {mesh}, ranks {list(first.ranks)}, spans hosts "
        f"{list(first.hosts)} (node ranks, {per_host} ranks a host){more}: its collectives in every "
        f"layer's forward and backward cross the network, which trains correctly but slowly; "
        f"{_fix(layout, first.dim, per_host)} (docs/operations.md, 'Tensor parallel across hosts')"
    )
