"""Where ranks and spares live when a job spans many hosts: pure functions, no I/O.

Hosts are the agents that said hello (one per machine). The coordinator turns their arrival into
node ranks and spare hosts (:func:`assign_hosts`), places ranks host-major (:func:`placement`:
rank ``r`` is local rank ``r % P`` on node ``r // P``, as torchrun does), picks the spares that
take a lost host's ranks (:func:`match_spares`: all from one spare host where one has enough, so a
lost node is replaced by one node) and the host a new spare starts on (:func:`spare_host`).

Once no spare host has room (the spare hosts took a lost host's ranks), single spares go onto
hosts that hold ranks, at most ``spare_share`` each: a process that dies alone is then still
replaced, by a spare on its own host, which takes its device (``LOCAL_RANK``). Such a spare never
takes another host's rank: its device is in use there, so a whole lost host still needs a spare
host (or waits for one to join, up to ``--spare-wait``). When a host with no ranks joins again,
the squeezed spares move to it (:func:`spares_to_move`, then :func:`squeezed_to_retire` as each
new one is ready), so that the next lost host finds its spares warm.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from checkpointless.errors import ConfigError

__all__ = [
    "HostView",
    "Placement",
    "assign_hosts",
    "match_spares",
    "move_chain",
    "pick_spares",
    "placement",
    "spare_host",
    "spare_share",
    "spares_to_move",
    "squeezed_to_retire",
    "without_spare",
]


@dataclass(frozen=True)
class Placement:
    local_rank: int
    local_world_size: int
    node_rank: int


def placement(rank: int, nproc_per_node: int) -> Placement:
    """Host-major placement of ``rank`` with ``nproc_per_node`` ranks on each node."""
    if nproc_per_node < 1 or rank < 0:
        raise ValueError(f"no placement for rank {rank} with {nproc_per_node} per node")
    return Placement(rank % nproc_per_node, nproc_per_node, rank // nproc_per_node)


def assign_hosts(
    agents: list[tuple[int, int]], nnodes: int, spare_nodes: int
) -> tuple[dict[int, int], list[int]]:
    """Node ranks and spare hosts from ``agents`` = [(host id, order hint)] in arrival order.

    Hosts with an order hint (>= 0, e.g. Slurm's node id) come first, lowest first; the rest in
    arrival order. The first ``nnodes`` become nodes 0.., the next ``spare_nodes`` spare hosts;
    extra agents also become spare hosts (more spares never hurt). Returns ({host: node rank},
    [spare host ids]).
    """
    if len(agents) < nnodes:
        raise ConfigError(f"{len(agents)} agents joined, but the job needs {nnodes} nodes (--nnodes)")
    hints = [order for _, order in agents if order >= 0]
    dup = [h for h, n in Counter(hints).items() if n > 1]
    if dup:
        raise ConfigError(f"two agents gave the same --node-order {dup[0]}; give each host its own")
    arrival = {host: i for i, (host, _) in enumerate(agents)}
    ordered = sorted(agents, key=lambda a: (a[1] < 0, a[1], arrival[a[0]]))
    nodes = {host: i for i, (host, _) in enumerate(ordered[:nnodes])}
    spares = [host for host, _ in ordered[nnodes:]]
    del spare_nodes  # the count to wait for; every agent past the nodes is a spare host
    return nodes, spares


@dataclass(frozen=True)
class HostView:
    """What :func:`spare_host` needs to know about a live host."""

    host: int
    ranks: int  # ranks it holds now
    procs: int  # live processes it runs (ranks and spares)


def spare_share(spares: int, rank_hosts: int) -> int:
    """How many spares a host that holds ranks may run besides them: its share of the job's
    ``spares`` over the ``rank_hosts`` live hosts holding ranks, rounded up, and at least one."""
    return max(1, -(-spares // max(1, rank_hosts)))


def spare_host(hosts: list[HostView], per_host: int, single_host: bool, share: int = 0) -> int | None:
    """The host a new spare starts on, or None when no host should take one.

    A spare belongs on a host that holds no ranks (a hot-spare host), so that a lost node's ranks
    move together to one healthy host; the least loaded first, at most ``per_host`` processes each.
    When none has room, a host that holds ranks takes it if it runs fewer than ``share`` spares
    besides its ranks (:func:`spare_share`; 0 turns this off), the one with the fewest spares
    first, so that single spares spread over the hosts. A one-machine job has only its own host,
    which then takes the spares itself.
    """
    if single_host:
        return hosts[0].host if hosts else None
    free = [h for h in hosts if h.ranks == 0 and h.procs < per_host]
    if free:
        return min(free, key=lambda h: (h.procs, h.host)).host
    room = [h for h in hosts if h.ranks > 0 and h.procs - h.ranks < share]
    if not room:
        return None
    return min(room, key=lambda h: (h.procs - h.ranks, h.procs, h.host)).host


def spares_to_move(hosts: list[HostView], squeezed: int, idle: int, spares: int, per_host: int) -> int:
    """How many spares to start on hosts that hold no ranks, in place of the ``squeezed`` idle
    spares that run beside ranks: those cannot take a lost host's ranks, so a spare host that
    joins should hold the pool instead. ``idle`` spares exist against a target of ``spares``;
    those above it are replacements already started (each retires one squeezed spare once
    ready), so they are not started twice. Never more than the free hosts have room for."""
    room = sum(per_host - h.procs for h in hosts if h.ranks == 0 and h.procs < per_host)
    return max(0, min(squeezed - max(0, idle - spares), room))


def squeezed_to_retire(squeezed: list[tuple[int, int]], idle: int, spares: int, arrived: int) -> list[int]:
    """The squeezed spares [(worker id, host)] to stop: one for each of the ``arrived`` spares
    (started on a host without ranks to move the pool there, and now ready), while ``idle``
    spares exceed the target of ``spares``; from the hosts that run the most of them, the newest
    first. Until a moved spare is ready nothing is stopped: an extra spare beside the ranks is no
    reason to lose a warm one."""
    extra = min(idle - spares, arrived, len(squeezed))
    if extra <= 0:
        return []
    per_host = Counter(host for _, host in squeezed)
    order = sorted(squeezed, key=lambda s: (-per_host[s[1]], s[1], -s[0]))
    return [wid for wid, _ in order[:extra]]


def match_spares(
    ranks: list[tuple[int, int]],
    ready: list[tuple[int, int]],
    holding: set[int],
    moving: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """Which ready spare takes which rank: {rank: worker id}, for as many ranks as can be served.

    ``ranks`` = [(rank, the host it was on)], ``ready`` = [(worker id, host id)], ``holding`` =
    the hosts that hold ranks. A spare on a host that holds ranks takes only a rank of its own
    host (the device that rank used is free there, and the others are taken); spares on spare
    hosts take the rest, from as few hosts as possible (:func:`pick_spares`). A rank whose own
    host has a spare uses it first, so that the spare hosts stay whole for a lost host.
    ``moving`` = {lost host: the spare host its ranks began moving to}: that host holds some of
    them by now, and its spares still take the rest (they are the lost host's slots there).
    """
    moving = moving or {}
    local: dict[int, list[int]] = {}
    for wid, host in sorted(ready):
        if host in holding:
            local.setdefault(host, []).append(wid)
    out: dict[int, int] = {}
    rest = []
    for rank, host in ranks:
        # its own host first, then each host its host's ranks moved on to, in order: a spare
        # host lost while the lost host's ranks were moving onto it moved them on again
        at = next((h for h in move_chain(host, moving) if local.get(h)), None)
        if at is not None:
            out[rank] = local[at].pop(0)
        else:
            rest.append(rank)
    free = pick_spares(len(rest), [(w, h) for w, h in ready if h not in holding])
    out.update(zip(rest, free, strict=False))
    return out


def move_chain(host: int, moving: Mapping[int, int]) -> list[int]:
    """``host``, then the host its ranks began moving to, then where that one's moved on to (it
    was lost in turn while they moved), and so on: a lost host's ranks belong together on the
    last host of the chain. Ends at a host seen before (a host that rejoined under its old id)."""
    chain = [host]
    while chain[-1] in moving and moving[chain[-1]] not in chain:
        chain.append(moving[chain[-1]])
    return chain


def without_spare(
    ranks: list[tuple[int, int]],
    starting: list[int],
    holding: set[int],
    moving: Mapping[int, int] | None = None,
) -> list[int]:
    """The ranks of ``ranks`` = [(rank, the host it was on)] that no starting spare is on its way
    to: ``starting`` = the hosts of the spares still starting, each paired with at most one rank
    by :func:`match_spares`'s rules (one beside ranks serves its host's rank, or a lost host's
    rank that moved there; one on a spare host serves any). Only these need a spare started."""
    moving = moving or {}
    left = Counter(starting)
    rest = []
    for rank, host in ranks:
        at = next((h for h in move_chain(host, moving) if h in holding and left[h]), None)
        if at is not None:
            left[at] -= 1
        else:
            rest.append(rank)
    out = []
    for rank in rest:
        at = next((h for h in sorted(left) if h not in holding and left[h]), None)
        if at is not None:
            left[at] -= 1
        else:
            out.append(rank)
    return out


def pick_spares(count: int, ready: list[tuple[int, int]]) -> list[int]:
    """Worker ids of ``count`` ready spares from ``ready`` = [(worker id, host id)].

    Takes them from as few hosts as possible: the host with the most ready spares first (so the
    ranks of a lost node land on one spare host together), lower ids first on ties.
    """
    per_host = Counter(host for _, host in ready)
    ordered = sorted(ready, key=lambda s: (-per_host[s[1]], s[1], s[0]))
    return [wid for wid, _ in ordered[:count]]
