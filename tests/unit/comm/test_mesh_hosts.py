"""Which tensor-parallel groups span hosts (comm/mesh_hosts.py): "tp" last and dividing
``--nproc-per-node`` keeps every group on one host; "tp" first, or a size that does not divide
the ranks of a host, splits groups, and the warning names the mesh, a group's ranks and hosts,
and the fix that applies. Checked exhaustively against placing each rank by hand."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest

from checkpointless.comm.mesh_coords import MeshLayout
from checkpointless.comm.mesh_hosts import SpanningGroup, group_ranks, spanning_groups, spanning_warning

pytestmark = pytest.mark.timeout(30)


def test_tp_last_and_dividing_the_host_keeps_every_group_on_one_host() -> None:
    layout = MeshLayout.of(("dp", "tp"), (2, 2), sharded={"tp"})
    assert group_ranks(layout, "tp") == [(0, 1), (2, 3)]
    assert spanning_groups(layout, per_host=2) == []  # the netns test's dp 2 x tp 2 on 2 hosts
    assert spanning_groups(layout, per_host=4) == []  # one host
    three_d = MeshLayout.of(("replicate", "shard", "tp"), (2, 2, 2), sharded={"shard", "tp"})
    assert spanning_groups(three_d, per_host=2) == spanning_groups(three_d, per_host=4) == []


def test_tp_first_splits_every_group_over_hosts_and_the_fix_says_put_it_last() -> None:
    layout = MeshLayout.of(("tp", "dp"), (2, 2), sharded={"tp"})
    assert group_ranks(layout, "tp") == [(0, 2), (1, 3)]
    spans = spanning_groups(layout, per_host=2)
    assert spans == [SpanningGroup("tp", (0, 2), (0, 1)), SpanningGroup("tp", (1, 3), (0, 1))]
    text = spanning_warning(layout, 2, spans)
    assert "mesh {'tp': 2, 'dp': 2}" in text and "ranks [0, 2]" in text and "hosts [0, 1]" in text
    assert "1 more" in text and "make 'tp' the mesh's last dimension" in text
    assert "mesh_dim_names=('dp', 'tp')" in text


def test_tp_size_not_dividing_the_host_splits_some_groups_and_the_fix_names_both_numbers() -> None:
    layout = MeshLayout.of(("dp", "tp"), (3, 2), sharded={"tp"})
    spans = spanning_groups(layout, per_host=3)  # ranks 0-2 on host 0, 3-5 on host 1
    assert spans == [SpanningGroup("tp", (2, 3), (0, 1))]
    text = spanning_warning(layout, 3, spans)
    assert "ranks [2, 3]" in text and "more" not in text
    assert "multiple of the tp size 2 (it is 3)" in text


def test_a_mesh_without_tp_has_nothing_to_warn_about() -> None:
    hsdp = MeshLayout.of(("replicate", "shard"), (2, 2), sharded={"shard"})
    assert group_ranks(hsdp, "tp") == [] and spanning_groups(hsdp, per_host=1) == []
    with pytest.raises(ValueError, match="per_host"):
        spanning_groups(hsdp, per_host=0)


@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp"), ("pp", "dp", "tp"), ("dp", "tp", "pp")])
def test_spanning_groups_match_placing_each_rank_by_hand(names: tuple[str, ...]) -> None:
    for shape in itertools.product((1, 2, 3), repeat=len(names)):
        layout = MeshLayout.of(names, shape, sharded={"tp"})
        world = layout.world_size
        for per_host in range(1, world + 1):
            want = []
            groups: dict[tuple[int, ...], list[int]] = {}
            for r in range(world):
                c = layout.coordinates(r)
                key = tuple(x for x, n in zip(c, names, strict=True) if n != "tp")
                groups.setdefault(key, []).append(r)
            for ranks in sorted(groups.values()):
                hosts = sorted({r // per_host for r in ranks})
                if len(hosts) > 1:
                    want.append((tuple(ranks), tuple(hosts)))
            got = [(s.ranks, s.hosts) for s in spanning_groups(layout, per_host)]
            assert got == want, (names, shape, per_host)
            tp = shape[names.index("tp")]
            if names[-1] == "tp" and per_host % tp == 0:
                assert got == [], (names, shape, per_host)  # the placement's promise


class _Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, object]]] = []

    def emit(self, event: str, **fields: object) -> None:
        self.emitted.append((event, fields))


def _member(rank: int, per_host: int, replacement: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank,
        is_replacement=replacement,
        placement=(rank % per_host, per_host, rank // per_host),
        world_size=4,
        record=SimpleNamespace(events=_Events()),
    )


def test_rank_0_warns_once_with_an_event_and_a_line_and_nobody_else_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from checkpointless.recovery.tp_hosts import warn_if_tp_spans_hosts

    tp_first = MeshLayout.of(("tp", "dp"), (2, 2), sharded={"tp"})
    first = _member(0, per_host=2)
    with caplog.at_level(logging.WARNING, logger="checkpointless"):
        warn_if_tp_spans_hosts(first, tp_first)  # type: ignore[arg-type]
    assert first.record.events.emitted == [
        (
            "tp_spans_hosts",
            {
                "mesh": {"tp": 2, "dp": 2},
                "per_host": 2,
                "groups": [
                    {"dim": "tp", "ranks": [0, 2], "hosts": [0, 1]},
                    {"dim": "tp", "ranks": [1, 3], "hosts": [0, 1]},
                ],
                "spanning": 2,
            },
        )
    ]
    assert "tensor-parallel group 'tp'" in caplog.text and "last dimension" in caplog.text
    for quiet in (_member(1, 2), _member(0, 2, replacement=True), _member(0, 4)):  # others; one host
        warn_if_tp_spans_hosts(quiet, tp_first)  # type: ignore[arg-type]
        assert quiet.record.events.emitted == []
    tp_last = _member(0, per_host=2)
    warn_if_tp_spans_hosts(tp_last, MeshLayout.of(("dp", "tp"), (2, 2), sharded={"tp"}))  # type: ignore[arg-type]
    assert tp_last.record.events.emitted == []
