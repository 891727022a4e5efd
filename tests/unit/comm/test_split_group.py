"""``dist.split_group`` under the job's default group (comm/split_group.py): four spawned ranks
make split groups and the ``dist.new_group`` groups over the same ranks, and every collective on
a split group gives what it gives on its twin, bitwise, in two generations with an abort between,
on the same Python objects. Torch's own ``split_group`` runs again once the job's group closes,
and invalid splits raise torch's errors on every rank alike."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from checkpointless.comm.split_group import global_splits
from tests.helpers.ranks import spawn_ranks

WORLD = 4


def _collectives(pg: Any, rank: int, gen: int) -> list[float]:
    """all_reduce, all_gather and broadcast (from the group's first rank) on ``pg``."""
    v = torch.tensor([rank * 1.37 + gen + 0.1], dtype=torch.float64)
    red = v.clone()
    dist.all_reduce(red, group=pg)
    got = [torch.zeros_like(v) for _ in range(pg.size())]
    dist.all_gather(got, v, group=pg)
    b = v.clone()
    dist.broadcast(b, src=dist.get_process_group_ranks(pg)[0], group=pg)
    return [red.item(), *(g.item() for g in got), b.item()]


def _run(rank: int, port: int) -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    from checkpointless.comm import split_group as ours
    from checkpointless.recovery.default_group import install_default_group

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timeout)
    default = install_default_group(rank, WORLD, timeout)
    assert dist.split_group is ours.split_group and c10d.split_group is ours.split_group
    # torch's rule: every rank makes every group, in the same order
    twins = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    split = dist.split_group(split_ranks=[[1, 0], [3, 2]], group_desc="halves")
    none = dist.split_group(split_ranks=[[0, 1]], timeout=datetime.timedelta(days=10000))
    twin_of_sub = dist.new_group([1, 3])
    parent = dist.new_group([1, 2, 3])
    sub = None
    if rank in (1, 2, 3):  # a parent over some ranks: only its ranks call, with its group ranks
        sub = dist.split_group(parent, split_ranks=[[2, 0], [1]])
    errors = []
    for bad in ([[0, 1], [1, 2]], [[]], [[0, 0]], [[0, 1, 2, 3, 0]]):
        try:
            dist.split_group(split_ranks=bad)
        except ValueError as e:
            errors.append(str(e))
    mine = twins[rank // 2]
    assert split is not None and split is not mine and split.group_desc == "halves"
    assert dist.get_process_group_ranks(split) == dist.get_process_group_ranks(mine)
    assert (none is None) == (rank >= 2)
    out: dict[str, Any] = {"errors": errors, "sub_ranks": None}
    if sub is not None:
        out["sub_ranks"] = dist.get_process_group_ranks(sub)
    held = {"split": split, "none": none, "sub": sub}
    for gen in (0, 1):
        default.configure(gen, store, time.monotonic() + 60, None)
        default.release()
        out[f"split{gen}"] = _collectives(split, rank, gen)
        out[f"twin{gen}"] = _collectives(mine, rank, gen)
        if none is not None:
            out[f"none{gen}"] = _collectives(none, rank, gen)
        if rank in (1, 3):
            out[f"sub{gen}"] = _collectives(sub, rank, gen)
            out[f"subtwin{gen}"] = _collectives(twin_of_sub, rank, gen)
        # the job's groups after the generation are the very objects the script holds
        made = default.made.groups() if default.made is not None else []
        assert all(pg is None or any(pg is m for m in made) for pg in held.values())
        dist.barrier()
        if gen == 0:
            default.abort("a peer was lost")  # every group, split ones included, as a fault does
    default.close()
    out["torch_again"] = dist.split_group is not ours.split_group and c10d.split_group is not ours.split_group
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(WORLD)], datetime.timedelta(seconds=30))
    return out


@pytest.mark.timeout(120)
def test_split_groups_reduce_like_new_groups_through_a_generation() -> None:
    res = spawn_ranks(_run, WORLD, (), timeout=100, what="split groups")
    for rank, r in res.items():
        for gen in (0, 1):
            assert r[f"split{gen}"] == r[f"twin{gen}"], (rank, r)
            if rank in (1, 3):
                assert r[f"sub{gen}"] == r[f"subtwin{gen}"], (rank, r)
        # a group rank translates through the parent's ranks: the parent's 2 and 0 are 3 and 1
        assert r["sub_ranks"] == {0: None, 1: [1, 3], 2: [2], 3: [1, 3]}[rank], (rank, r)
        assert r["torch_again"], rank
        assert ("none0" in r) == (rank < 2), (rank, r)
        assert r["errors"][0] == "rank 1 is in split 0 and in split 1: the splits must not overlap"
        assert [e.split(" (")[0] for e in r["errors"][1:]] == [
            "the split group cannot be empty",
            "the split group cannot have duplicate ranks",
            "the split group's size should be less or equal to the world_size set by init_process_group",
        ]
    # every rank of a group saw the same sums, gathers and broadcasts
    assert res[0]["split1"] == res[1]["split1"] and res[2]["split1"] == res[3]["split1"]
    assert res[0]["split0"] != res[2]["split0"]


def test_global_splits_translate_through_the_parent_and_refuse_bad_input() -> None:
    assert global_splits([[1, 0], [2]], [4, 6, 7], 8) == [[4, 6], [7]]
    assert global_splits([[0]], [5], 8) == [[5]]
    with pytest.raises(ValueError, match="cannot be None or empty"):
        global_splits([], [0, 1], 2)
    with pytest.raises(ValueError, match="not a group rank of the parent group"):
        global_splits([[0, 3]], [0, 1, 2], 4)
    with pytest.raises(ValueError, match="in split 0 and in split 2"):
        global_splits([[0], [1], [2, 0]], [0, 1, 2], 3)


def _torch_world(rank: int, port: int) -> dict[str, Any]:
    from checkpointless.comm import split_group as ours

    dist.init_process_group("gloo", store=dist.HashStore(), rank=rank, world_size=1)

    def refusal() -> str:
        try:
            dist.split_group(split_ranks=[[0]])
        except RuntimeError as e:
            return str(e)
        return "no error"

    before = refusal()
    ours.install()  # as if a job had made its group: the world's default group is still torch's
    installed = ours.installed()
    after = refusal()
    ours.uninstall()
    dist.destroy_process_group()
    return {"before": before, "after": after, "installed": installed, "back": not ours.installed()}


@pytest.mark.timeout(60)
def test_a_world_of_torch_own_gets_torch_own_split_group() -> None:
    r = spawn_ranks(_torch_world, 1, (), timeout=50, what="torch's world")[0]
    assert r["installed"] and r["back"], r
    assert r["before"] == r["after"] and "not safe to split" in r["before"], r
