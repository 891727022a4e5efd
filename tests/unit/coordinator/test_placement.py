"""Many-host decisions as pure functions, and the coordinator's handling of a lost host."""

from __future__ import annotations

import pytest

from checkpointless.coordinator import Coordinator, Emit, Kill, Log, Send, Spawn
from checkpointless.coordinator.conditions import Conditions
from checkpointless.coordinator.rules.placement import (
    HostView,
    assign_hosts,
    match_spares,
    move_chain,
    pick_spares,
    placement,
    spare_host,
    spare_share,
    spares_to_move,
    squeezed_to_retire,
    without_spare,
)
from checkpointless.errors import ConfigError
from checkpointless.protocol import Abort, Assign, Recover, Recovered, SpareReady, Stopped
from checkpointless.recovery.torchrun import torchrun_env
from tests.helpers.coordinator import host_coordinator

pytestmark = pytest.mark.timeout(10)


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


def test_without_a_spare_host_single_spares_go_beside_the_ranks() -> None:
    # hosts 0 and 1 hold 2 ranks each (host 1 took a lost host's ranks); the job keeps 2 spares
    share = spare_share(2, 2)
    assert share == 1 and spare_share(8, 3) == 3 and spare_share(0, 0) == 1
    hosts = [HostView(0, 2, 2), HostView(1, 2, 2)]
    assert spare_host(hosts, 2, single_host=False, share=share) == 0
    assert spare_host([HostView(0, 2, 3), HostView(1, 2, 2)], 2, False, share) == 1  # spread them
    assert spare_host([HostView(0, 2, 3), HostView(1, 2, 3)], 2, False, share) is None  # all full
    assert spare_host(hosts, 2, single_host=False, share=0) is None  # strict: spare hosts only
    # a spare host with room is still preferred over a host holding ranks
    assert spare_host([HostView(0, 2, 2), HostView(5, 0, 1)], 2, False, share) == 5


def test_a_spare_beside_ranks_takes_only_its_own_hosts_rank() -> None:
    holding = {0, 1}
    ready = [(10, 0), (11, 1), (12, 7), (13, 7)]  # one spare on each rank host, two on spare host 7
    # a process fault on host 1 uses host 1's spare: the spare host stays whole for a lost host
    assert match_spares([(3, 1)], ready, holding) == {3: 11}
    # a lost host's ranks (host 2) go to the spare host, never to a spare beside other ranks
    assert match_spares([(4, 2), (5, 2)], ready, holding) == {4: 12, 5: 13}
    assert match_spares([(4, 2), (5, 2)], [(10, 0), (11, 1)], holding) == {}
    assert match_spares([(0, 0), (4, 2)], [(10, 0), (11, 1)], holding) == {0: 10}


def test_a_lost_hosts_last_ranks_follow_the_first_to_its_spare_host() -> None:
    # host 2 was lost; rank 4 already moved to spare host 3, whose second spare became ready
    # only later: host 3 now holds a rank, yet its spare is still rank 5's slot there
    holding = {0, 1, 3}
    assert match_spares([(5, 2)], [(13, 3)], holding) == {}, "without the move: a rank host's spare"
    assert match_spares([(5, 2)], [(13, 3)], holding, {2: 3}) == {5: 13}
    # a move does not lend other hosts' spares, nor take a rank whose own host has a spare
    assert match_spares([(5, 2)], [(11, 1)], holding, {2: 3}) == {}
    assert match_spares([(1, 1), (5, 2)], [(11, 1), (13, 3)], holding, {2: 3}) == {1: 11, 5: 13}


def test_a_lost_hosts_ranks_follow_on_when_their_spare_host_is_lost_too() -> None:
    # host 2 was lost; rank 4 moved to spare host 3 and rank 5 waited there; then host 3 was
    # lost and rank 4 moved on to host 4: rank 5 follows it there, not to another host's spare
    holding = {0, 1, 4}
    moving = {2: 3, 3: 4}
    assert match_spares([(5, 2)], [(14, 4)], holding, moving) == {5: 14}
    assert match_spares([(5, 2)], [(14, 4)], holding, {2: 3}) == {}, "without the second move"
    assert move_chain(2, moving) == [2, 3, 4] and move_chain(1, moving) == [1]
    assert move_chain(2, {2: 3, 3: 2}) == [2, 3], "a host that rejoined under its old id ends it"


def test_a_starting_spare_is_on_its_way_only_to_a_rank_it_could_take() -> None:
    holding = {0, 1}
    # rank 1 (host 0, live) has its spare starting there; rank 5 (lost host 2) has none: a spare
    # starts for rank 5 only, not a second one for rank 1
    assert without_spare([(1, 0), (5, 2)], [0], holding) == [5]
    # two starting beside host 0's ranks (one a refill) do not cover a lost host's rank
    assert without_spare([(1, 0), (5, 2)], [0, 0], holding) == [5]
    # one on a spare host covers any rank (the first waiting); each spare covers one rank
    assert without_spare([(1, 0), (5, 2)], [3], holding) == [5]
    assert without_spare([(4, 2), (5, 2)], [3, 3], holding) == []
    # a lost host's rank whose peer moved to host 4 (now holding) is covered by a spare there
    assert without_spare([(5, 2)], [4], {0, 1, 4}, {2: 4}) == []
    assert without_spare([(5, 2)], [4], {0, 1, 4}) == [5]


def test_a_condition_is_reported_when_it_begins_and_ends_only() -> None:
    cond = Conditions()
    changes = [
        cond.update("no_spare_host", on, "none left") for on in (False, True, True, True, False, False)
    ]
    assert [(c.name, c.active) if c else None for c in changes] == [
        None,
        ("no_spare_host", True),
        None,
        None,
        ("no_spare_host", False),
        None,
    ]


def test_a_lost_node_is_replaced_from_one_spare_host() -> None:
    ready = [(10, 5), (11, 6), (12, 6), (13, 5), (14, 5)]
    assert pick_spares(2, ready) == [10, 13]  # host 5 has the most ready spares
    assert pick_spares(3, [(1, 2), (2, 3)]) == [1, 2]  # fewer than asked: all of them


# host 1 is node 0, host 0 is node 1, host 2 the spare host: placement follows --node-order
NODE_ORDERS = (1, 0, 2)


def test_coordinator_places_nodes_and_moves_a_lost_host_to_the_spare_host() -> None:
    c, spawns = host_coordinator(orders=NODE_ORDERS)
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
    c.spares.refill(101.0)
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
    # no spare host is left: single spares go onto the hosts holding ranks, one each
    assert [(x.role, x.host) for x in out if isinstance(x, Spawn)] == [("spare", 1), ("spare", 2)]
    conds = [x.fields for x in out if isinstance(x, Emit) and x.event == "condition"]
    assert [(e["name"], e["active"]) for e in conds] == [("no_spare_host", True)]
    # the lost host's processes are gone for good: a late hello from one is refused
    assert not c.on_connected(2, 105.0)
    assert not [x for x in out if isinstance(x, Kill) and x.host != 0]
    assert isinstance(next(x.message for x in out if isinstance(x, Send)), Abort)

    # the round formed (tested elsewhere); the spares beside the ranks start and say ready
    c.round, c.generation = None, 1
    for wid in (6, 7):
        c.on_started(wid, f"10.0.0.9:{30000 + wid}")
        c.on_connected(wid, 105.0)
        c.on_message(wid, SpareReady(), 105.0, 1e9)
    c.drain()
    # then one process dies on each host: each host's own spare takes its rank, bitwise the same
    # device slot (LOCAL_RANK) it freed
    c.on_exit(0, -9, False, "SIGKILL", "", 106.0, 1e9)  # rank 0, host 1
    c.on_exit(4, -9, False, "SIGKILL", "", 106.0, 1e9)  # rank 2, host 2
    c.tick(106.1, 1e9)
    out = c.drain()
    new = {x.message.rank: x.worker_id for x in out if isinstance(x, Send) and isinstance(x.message, Assign)}
    assert new == {0: 6, 2: 7}
    assert c.stopping is None


def test_no_spare_is_logged_once_not_per_tick() -> None:
    c, spawns = host_coordinator(orders=NODE_ORDERS)
    for s in spawns:
        c.on_started(s.worker_id, f"10.0.0.{s.host}:{30000 + s.worker_id}")
        c.on_connected(s.worker_id, 100.0)
    c.round, c.generation = None, 0
    c.on_host_lost(2, "connection closed", 100.5, 1e9)  # the only spare host, before any spare
    c.on_host_lost(0, "connection closed", 101.0, 1e9)  # then a node: its ranks wait for a host
    out = []
    for i in range(200):  # four seconds of the shell's 20 ms loop
        c.on_agent_seen(1, 101.0 + i * 0.02)
        c.tick(101.0 + i * 0.02, 1e9)
        out += c.drain()
    assert c.stopping is None
    logs = [x.text for x in out if isinstance(x, Log) and "no hot spare" in x.text]
    assert len(logs) == 1, logs
    assert not [x for x in out if isinstance(x, Spawn) and x.host != 3], "no host may take them"
    # a healed host joins: it takes the spares, the ranks move there and both conditions end
    c.add_host(3, "10.0.0.3", True, 105.0)
    for _ in range(3):
        c.on_agent_seen(1, 105.1)
        c.tick(105.1, 1e9)
    out = c.drain()
    new = [x for x in out if isinstance(x, Spawn)]
    assert [(x.host, x.role) for x in new] == [(3, "spare"), (3, "spare")]
    for x in new:
        c.on_started(x.worker_id, f"10.0.0.3:{30000 + x.worker_id}")
        c.on_connected(x.worker_id, 105.2)
        c.on_message(x.worker_id, SpareReady(), 105.2, 1e9)
    c.on_agent_seen(1, 105.3)
    c.tick(105.3, 1e9)
    out += c.drain()
    ended = [
        (x.fields["name"], x.fields["active"]) for x in out if isinstance(x, Emit) and x.event == "condition"
    ]
    assert ("no_spare_host", False) in ended and ("spare_wait", False) in ended, ended


def test_a_rejoined_host_is_a_spare_host() -> None:
    c, _ = host_coordinator(orders=NODE_ORDERS)
    c.round = None
    c.on_host_lost(0, "connection closed", 101.0, 1e9)
    c.drain()
    c.round = None  # (the round's progress is tested above)
    c.add_host(3, "10.0.0.0", True, 110.0)
    out = c.drain()
    # spares only, spread over the hosts that hold no ranks: the old host never gets ranks back
    assert [(s.role, s.host) for s in out if isinstance(s, Spawn)] == [("spare", 2), ("spare", 3)]
    assert c.hosts[0].lost and c.hosts[3].node_rank is None


def _spares(c: Coordinator, out: list[object], at: float) -> list[tuple[int, int]]:
    """The spares spawned in ``out``, started and ready: [(worker id, host)]."""
    new = [(x.worker_id, x.host) for x in out if isinstance(x, Spawn) and x.role == "spare"]
    for wid, host in new:
        c.on_started(wid, f"10.0.0.{host}:{30000 + wid}")
        c.on_connected(wid, at)
    return new


def _running_with_spares(c: Coordinator, spawns: list[Spawn]) -> list[tuple[int, int]]:
    """Every rank started and joined, the spare pool spawned and started: [(worker id, host)]."""
    for s in spawns:
        c.on_started(s.worker_id, f"10.0.0.{s.host}:{30000 + s.worker_id}")
        c.on_connected(s.worker_id, 100.0)
    c.drain()
    c.round, c.generation = None, 0
    for m in c.procs.values():
        m.joined = True
    c.spares.refill(101.0)
    return _spares(c, list(c.drain()), 101.0)


def _ready(c: Coordinator, wid: int, at: float) -> list[object]:
    c.on_message(wid, SpareReady(), at, 1e9)
    return list(c.drain())


def _form_round(c: Coordinator, at: float) -> list[object]:
    """Every rank reports, the plan goes out, every rank recovers: the round has formed."""
    r = c.round
    assert r is not None
    for _, m in sorted(c.ranks.items()):
        stopped = Stopped(for_generation=r.target, committed_step=5, valid=m.joined)
        c.on_message(m.worker_id, stopped, at, 1e9)
    c.tick(at + 0.01, 1e9)
    out = list(c.drain())
    assert any(isinstance(x, Send) and isinstance(x.message, Recover) for x in out)
    for m in list(c.ranks.values()):
        c.on_message(m.worker_id, Recovered(generation=r.target), at + 0.02, 1e9)
    assert c.round is None, "the round formed"
    return out + list(c.drain())


@pytest.mark.parametrize("case", ["after", "during", "starting", "fault"])
def test_a_host_that_joins_takes_the_spares_squeezed_beside_ranks(case: str) -> None:
    """A lost host's ranks use up the spare host, so the pool is refilled beside the ranks, where
    it could not take a whole lost host's ranks. A host that joins (after the round, or during it:
    then once it has formed) gets the pool: spares start there, and each squeezed spare is
    stopped once one of them is ready, so the next lost host finds its spares warm. A squeezed
    spare stopped while still starting is no failed start ("starting"), and one being stopped is
    never given a rank ("fault": a rank on its host fails before it has exited)."""
    c, spawns = host_coordinator(orders=NODE_ORDERS)
    for wid, _ in _running_with_spares(c, spawns):
        _ready(c, wid, 101.0)
    for h in (1, 2):
        c.on_agent_seen(h, 104.5)
    c.tick(104.5, 1e9)  # host 0 (ranks 2, 3) is lost: they take the spare host's spares
    squeezed = _spares(c, list(c.drain()), 104.6)
    assert sorted(h for _, h in squeezed) == [1, 2], "no spare host left: the pool goes beside ranks"
    if case != "starting":
        for wid, _ in squeezed:
            _ready(c, wid, 104.7)
    if case == "during":
        c.add_host(3, "10.0.0.3", True, 104.8)
        assert not [x for x in c.drain() if isinstance(x, Spawn)], "not while the round places spares"
    out = _form_round(c, 105.0)
    if case != "during":
        assert not [x for x in out if isinstance(x, Spawn)]
        c.add_host(3, "10.0.0.3", True, 106.0)
        out = list(c.drain())
    moving = _spares(c, out, 106.1)
    assert [h for _, h in moving] == [3, 3], "the joined host takes a spare host's worth"
    retired = [x for x in _ready(c, moving[0][0], 106.2) if isinstance(x, Kill)]
    assert len(retired) == 1 and retired[0].worker_id in {w for w, _ in squeezed}, "one ready, one stopped"
    if case == "fault":
        # rank 0 fails on the host of the spare being stopped: the ready spare host takes it
        assert c.procs[retired[0].worker_id].host == c.ranks[0].host
        c.on_exit(c.ranks[0].worker_id, -9, False, "SIGKILL", "", 106.25, 1e9)
        c.tick(106.26, 1e9)
        got = {
            x.message.rank: x.worker_id
            for x in c.drain()
            if isinstance(x, Send) and isinstance(x.message, Assign)
        }
        assert got == {0: moving[0][0]}, got
        return
    own = case == "starting"  # the agent reports a process it killed before it was ready as its own
    c.on_exit(retired[0].worker_id, -9, own, "SIGKILL", "", 106.3, 1e9)
    assert not [x for x in c.drain() if isinstance(x, Spawn)], "a stopped squeezed spare is not replaced"
    retired += [x for x in _ready(c, moving[1][0], 106.4) if isinstance(x, Kill)]
    assert sorted(x.worker_id for x in retired) == sorted(w for w, _ in squeezed)
    c.on_exit(retired[1].worker_id, -9, own, "SIGKILL", "", 106.5, 1e9)
    assert not [x for x in c.drain() if isinstance(x, Spawn | Kill)]
    idle = sorted((m.worker_id, m.host) for m in c.procs.values() if m.role == "spare" and m.rank is None)
    assert idle == moving, "the pool is the joined host's two spares, and nothing else"
    assert c.ledger.early_spare_deaths == 0 and c.stopping is None, "a stopped spare is no failed start"


def test_a_spare_hosts_own_ready_spares_do_not_stand_in_for_squeezed_ones() -> None:
    """Four spares, a spare host with room for two: two are squeezed beside the ranks. A host that
    joins starts two in their place; when the first is ready, one squeezed spare is stopped, not
    both (the spare host's two were in the pool already), so the pool never drops below four
    ready-or-starting spares."""
    c, spawns = host_coordinator(spares=4, orders=NODE_ORDERS)
    pool = _running_with_spares(c, spawns)
    assert sorted(h for _, h in pool) == [0, 1, 2, 2], "two on the spare host, two squeezed"
    for wid, _ in pool:
        _ready(c, wid, 101.0)
    c.add_host(3, "10.0.0.3", True, 106.0)
    moving = _spares(c, list(c.drain()), 106.1)
    assert [h for _, h in moving] == [3, 3]
    first = [x.worker_id for x in _ready(c, moving[0][0], 106.2) if isinstance(x, Kill)]
    second = [x.worker_id for x in _ready(c, moving[1][0], 106.3) if isinstance(x, Kill)]
    squeezed = {w for w, h in pool if h in (0, 1)}
    assert len(first) == 1 and len(second) == 1 and {*first, *second} == squeezed, (first, second)


def test_spares_move_to_a_spare_host_only_in_place_of_squeezed_ones() -> None:
    views = [HostView(0, 2, 3), HostView(1, 2, 3), HostView(2, 0, 0)]
    assert spares_to_move(views, squeezed=2, idle=2, spares=2, per_host=2) == 2
    assert spares_to_move(views, squeezed=2, idle=4, spares=2, per_host=8) == 0, "already started"
    assert spares_to_move(views, squeezed=2, idle=3, spares=2, per_host=8) == 1
    assert spares_to_move(views, squeezed=2, idle=2, spares=2, per_host=1) == 1, "room for one"
    assert spares_to_move(views[:2], squeezed=2, idle=2, spares=2, per_host=2) == 0, "no free host"
    # one stopped per moved spare that is ready, from the host running the most squeezed spares
    assert squeezed_to_retire([(5, 0), (6, 1), (7, 1)], idle=4, spares=2, arrived=1) == [7]
    assert squeezed_to_retire([(5, 0), (6, 1)], idle=4, spares=2, arrived=0) == []
    assert squeezed_to_retire([(5, 0), (6, 1)], idle=2, spares=2, arrived=2) == []
    assert squeezed_to_retire([(5, 0), (6, 1)], idle=5, spares=2, arrived=3) == [5, 6]


def test_a_lost_hosts_last_rank_follows_its_first_when_the_spare_host_is_lost_too() -> None:
    """Host 0 (ranks 2, 3) is lost while only one of the spare host's spares is ready: rank 2
    moves there, rank 3 waits for the second. Then the spare host is lost too, and a new host
    joins; its spares become ready one after the other. Both ranks must land there (seen in a
    local run: rank 3 was never given the second spare and the job failed at --spare-wait)."""
    c, spawns = host_coordinator(orders=NODE_ORDERS)
    pool = _running_with_spares(c, spawns)
    assert [h for _, h in pool] == [2, 2]
    _ready(c, pool[0][0], 101.0)  # the second is still starting
    for h in (1, 2):
        c.on_agent_seen(h, 104.5)
    c.tick(104.5, 1e9)
    out = list(c.drain())
    first = {
        x.message.rank: x.worker_id for x in out if isinstance(x, Send) and isinstance(x.message, Assign)
    }
    assert first == {2: pool[0][0]}, first
    c.on_host_lost(2, "its agent's connection closed", 104.6, 1e9)
    c.drain()
    c.add_host(3, "10.0.0.3", True, 104.7)
    c.on_agent_seen(1, 104.8)
    c.tick(104.8, 1e9)
    new = _spares(c, list(c.drain()), 104.8)
    assert [h for _, h in new] == [3, 3], new
    got: dict[int, int] = {}
    for i, (wid, _) in enumerate(new):
        at = 105.0 + 0.02 * i
        out = _ready(c, wid, at)
        c.on_agent_seen(1, at)
        c.on_agent_seen(3, at)
        c.tick(at, 1e9)
        out += list(c.drain())
        got.update(
            {
                x.message.rank: x.worker_id
                for x in out
                if isinstance(x, Send) and isinstance(x.message, Assign)
            }
        )
    assert got == {2: new[0][0], 3: new[1][0]}, got
    assert c.stopping is None
