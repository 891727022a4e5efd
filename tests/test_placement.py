"""Many-host decisions as pure functions, and the coordinator's handling of a lost host."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointless.coordinator import Coordinator, Kill, Send, Spawn
from checkpointless.coordinator.placement import HostView, assign_hosts, pick_spares, placement, spare_host
from checkpointless.errors import ConfigError
from checkpointless.launcher.model import LaunchConfig
from checkpointless.protocol import Abort, Assign, SpareReady
from checkpointless.recovery.torchrun import torchrun_env

pytestmark = pytest.mark.timeout(10)
SCRIPT = str(Path(__file__).parent / "scripts" / "slow_steps.py")


def test_ranks_are_placed_host_major() -> None:
    assert [placement(r, 2) for r in range(4)] == [
        placement(0, 2),
        placement(1, 2),
        placement(2, 2),
        placement(3, 2),
    ]
    p = placement(3, 2)
    assert (p.local_rank, p.local_world_size, p.node_rank) == (1, 2, 1)
    assert torchrun_env(3, 4, 1, 2, 1) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
    }


def test_hosts_become_nodes_by_order_hint_then_arrival() -> None:
    nodes, spares = assign_hosts([(7, 2), (8, -1), (9, 0), (10, 1)], nnodes=2, spare_nodes=1)
    assert nodes == {9: 0, 10: 1} and spares == [7, 8]
    nodes, spares = assign_hosts([(1, -1), (2, -1), (3, -1)], nnodes=2, spare_nodes=1)
    assert nodes == {1: 0, 2: 1} and spares == [3]
    with pytest.raises(ConfigError, match="needs 3 nodes"):
        assign_hosts([(1, -1)], nnodes=3, spare_nodes=0)
    with pytest.raises(ConfigError, match="same --node-order 1"):
        assign_hosts([(1, 1), (2, 1)], nnodes=1, spare_nodes=1)


def test_spares_start_on_hosts_without_ranks_only() -> None:
    hosts = [HostView(0, 2, 2), HostView(1, 0, 1), HostView(2, 0, 0)]
    assert spare_host(hosts, per_host=2, single_host=False) == 2  # the least loaded spare host
    assert spare_host([HostView(0, 2, 2), HostView(1, 0, 2)], 2, single_host=False) is None  # full
    assert spare_host([HostView(0, 2, 2), HostView(1, 2, 2)], 2, single_host=False) is None
    assert spare_host([HostView(0, 3, 4)], 2, single_host=True) == 0  # one machine takes its own


def test_a_lost_node_is_replaced_from_one_spare_host() -> None:
    ready = [(10, 5), (11, 6), (12, 6), (13, 5), (14, 5)]
    assert pick_spares(2, ready) == [10, 13]  # host 5 has the most ready spares
    assert pick_spares(3, [(1, 2), (2, 3)]) == [1, 2]  # fewer than asked: all of them


def _coordinator() -> tuple[Coordinator, list[Spawn]]:
    cfg = LaunchConfig(
        script=SCRIPT,
        nproc=4,
        spares=2,
        nnodes=2,
        nproc_per_node=2,
        spare_nodes=1,
        local_agent=False,
        lease=3,
    )
    c = Coordinator(cfg, "job", {"kind": "rootless", "timeout": 60})
    for host, order in ((0, 1), (1, 0), (2, 2)):
        c.add_host(host, f"10.0.0.{host}", True, 100.0, order)
    c.start(100.0)
    spawns = [x for x in c.drain() if isinstance(x, Spawn)]
    return c, spawns


def test_coordinator_places_nodes_and_moves_a_lost_host_to_the_spare_host() -> None:
    c, spawns = _coordinator()
    # node 0 is host 1 (order 0), node 1 is host 0; ranks host-major
    assert [(s.worker_id, s.host) for s in spawns] == [(0, 1), (1, 1), (2, 0), (3, 0)]
    for s in spawns:
        c.on_started(s.worker_id, f"10.0.0.{s.host}:{30000 + s.worker_id}")
        c.on_connected(s.worker_id, 100.0)
    assigns = [x.message for x in c.drain() if isinstance(x, Send) and isinstance(x.message, Assign)]
    assert [(a.rank, a.local_rank, a.node_rank) for a in assigns] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]
    # pretend generation 0 formed: spares go to the spare host (2), a node's worth
    c.round = None
    c.generation = 0
    for m in c.procs.values():
        m.joined = True
    c._refill_spares(101.0)
    spares = [x for x in c.drain() if isinstance(x, Spawn)]
    assert [(s.role, s.host) for s in spares] == [("spare", 2), ("spare", 2)]
    for s in spares:
        c.on_started(s.worker_id, f"10.0.0.2:{30000 + s.worker_id}")
        c.on_connected(s.worker_id, 101.0)
        c.on_message(s.worker_id, SpareReady(), 101.0, 1e9)
    c.drain()
    # host 0 (ranks 2, 3) goes silent: after the lease it is lost, both ranks move to host 2
    for h in (1, 2):
        c.on_agent_seen(h, 104.5)
    c.tick(104.5, 1e9)
    out = c.drain()
    assert c.hosts[0].lost and not c.hosts[1].lost
    sent = {(x.worker_id, type(x.message).__name__) for x in out if isinstance(x, Send)}
    assert {(0, "Abort"), (1, "Abort")} <= sent
    new = {x.message.rank: x.worker_id for x in out if isinstance(x, Send) and isinstance(x.message, Assign)}
    assert new == {2: 4, 3: 5}
    assert not [x for x in out if isinstance(x, Spawn)], "no spare host is left to refill on"
    # the lost host's processes are gone for good: a late hello from one is refused
    assert not c.on_connected(2, 105.0)
    assert not [x for x in out if isinstance(x, Kill) and x.host != 0]
    assert isinstance(next(x.message for x in out if isinstance(x, Send)), Abort)


def test_a_rejoined_host_is_a_spare_host() -> None:
    c, _ = _coordinator()
    c.round = None
    c.on_host_lost(0, "connection closed", 101.0, 1e9)
    c.drain()
    c.round = None  # (the round's progress is tested above)
    c.add_host(3, "10.0.0.0", True, 110.0)
    out = c.drain()
    # spares only, spread over the hosts that hold no ranks: the old host never gets ranks back
    assert [(s.role, s.host) for s in out if isinstance(s, Spawn)] == [("spare", 2), ("spare", 3)]
    assert c.hosts[0].lost and c.hosts[3].node_rank is None
