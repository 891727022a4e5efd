"""Groups a script makes with ``dist.new_group`` (comm/script_groups.py): the timeout clamp, the
store keys and the group lists as pure functions; two ranks' registries (threads, one store)
forming, aborting and re-forming their groups, and disagreeing; and ``dist.new_group`` itself
under ``checkpointless.init()`` run plainly (a world of one)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from checkpointless.comm.script_groups import (
    MAX_TIMEOUT,
    GroupEntry,
    GroupsDisagree,
    ScriptGroups,
    clamp_timeout,
    disagreement,
    group_key,
    parse_catalog,
    torch_delegates_new_group,
)
from checkpointless.errors import CommAborted

pytestmark = pytest.mark.timeout(120)


def test_clamp_keeps_what_poll_accepts_and_cuts_the_rest() -> None:
    import select

    huge = datetime.timedelta(days=10000)  # Lightning's prepare_data group
    assert clamp_timeout(huge) == MAX_TIMEOUT
    assert clamp_timeout(None) is None
    assert clamp_timeout(datetime.timedelta(seconds=30)) == datetime.timedelta(seconds=30)
    assert clamp_timeout(datetime.timedelta(seconds=-1)) == datetime.timedelta(0)
    assert clamp_timeout(MAX_TIMEOUT) == MAX_TIMEOUT
    # the clamp is exactly what poll() takes, and one millisecond more overflows
    p = select.poll()
    p.poll(0)
    with pytest.raises(OverflowError):
        p.poll(int(MAX_TIMEOUT.total_seconds() * 1000) + 1)
    with pytest.raises(OverflowError):
        p.poll(huge.total_seconds() * 1000)


def test_keys_follow_the_sequence_number_and_the_ranks() -> None:
    assert group_key("3", [0, 1]) == "g3.r0.1"
    # the same ranks made twice are two groups; the same number over other ranks too
    assert group_key("3", [0, 1]) != group_key("4", [0, 1])
    assert group_key("3", [0, 1]) != group_key("3", [0, 2])
    # a long rank list is hashed: short, and still a pure function of (number, ranks)
    long = list(range(64))
    assert group_key("5", long) == group_key("5", list(range(64)))
    assert len(group_key("5", long)) < 40 and group_key("5", long) != group_key("5", long[:-1])
    # use_local_synchronization names a group by a hash of its ranks, not by a number
    assert group_key("1234abcd", [2, 3]) == "g1234abcd.r2.3"


def test_group_lists_round_trip_and_name_what_is_missing() -> None:
    a, b, c = GroupEntry("1", (0, 1)), GroupEntry("2", (0, 1, 2)), GroupEntry("3", (1, 2))
    text = "\n".join(e.line() for e in (a, b, c))
    assert parse_catalog(text) == {a, b, c}
    assert parse_catalog("") == set()
    assert disagreement([a, b], 0, {1: {a, b, c}, 2: {b, c}}) is None
    # rank 1 never made #2; rank 2 made its #2 over other ranks
    why = disagreement([a, b], 0, {1: {a}, 2: {GroupEntry("2", (1, 2)), c}})
    assert why is not None
    assert "dist.new_group #2 over ranks [0, 1, 2] was made by ranks [0] but not by ranks [1, 2]" in why
    assert "their #2 is over ranks [1, 2]" in why and "same order" in why
    # the rank that lacks a group sees it in a peer's list and says so too
    why = disagreement([a], 1, {0: {a, b}})
    assert why is not None and "#2 over ranks [0, 1, 2] was made by ranks [0] but not by ranks [1]" in why


def test_a_rank_still_making_its_groups_judges_only_the_one_it_waits_for() -> None:
    """A rank waiting for the makers of #2 while a peer has sealed its whole list (#1-#3): the
    peer's #3, which this rank has yet to make, is no disagreement (it was one, spuriously, in
    the Megatron job under load: every group of the peer's list over this rank was named)."""
    a, b, c = GroupEntry("1", (0, 1)), GroupEntry("2", (0, 1)), GroupEntry("3", (0, 1))
    assert disagreement([b], 0, {1: {a, b, c}}) is not None  # the whole lists compared
    assert disagreement([b], 0, {1: {a, b, c}}, only=b) is None
    why = disagreement([b], 0, {1: {a, c}}, only=b)  # the peer sealed without #2: it never will
    assert why is not None and "#2 over ranks [0, 1] was made by ranks [0] but not by ranks [1]" in why
    assert "#3" not in why.split(". Every")[0]


def _pair(store: dist.Store) -> list[ScriptGroups]:
    timeout = datetime.timedelta(seconds=20)
    return [ScriptGroups(r, 2, timeout, None) for r in range(2)]


def _both(fn: Any) -> list[Any]:
    """``fn(rank)`` on two threads at once: each rank's result or exception."""
    out: list[Any] = [None, None]

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_two_ranks_form_abort_and_reform_the_same_group_objects() -> None:
    store = dist.HashStore()
    regs = _pair(store)
    pgs = [reg.create([0, 1], datetime.timedelta(days=10000), group_name="1") for reg in regs]
    solo = [reg.create([1], None, group_name="2") for reg in regs]
    assert solo[0] is None and solo[1] is not None  # rank 0 is not a member
    assert all(pg is not None and pg.timeout == MAX_TIMEOUT for pg in pgs)
    for gen in (0, 1):
        res = _both(lambda r, gen=gen: regs[r].configure(gen, store, time.monotonic() + 30, None))
        assert res == [None, None], res
        sums = _both(lambda r: _allreduce(pgs[r], float(r + 1)))
        assert sums == [3.0, 3.0]
        if gen == 0:
            # rank 0 waits on a peer that never comes: an abort from another thread wakes it
            t = torch.ones(1)
            work = pgs[0].allreduce([t])  # type: ignore[union-attr]
            threading.Timer(0.2, regs[0].abort, args=("peer lost",)).start()
            with pytest.raises(CommAborted, match="peer lost"):
                work.wait()
            regs[1].abort("peer lost")
            with pytest.raises(CommAborted):
                regs[0].check()
    assert [reg.groups() for reg in regs] == [[pgs[0]], [pgs[1], solo[1]]]
    # both at once: rank 0's aborted allreduce of generation 0 still holds a gloo thread, which
    # only rank 1's side closing (or gloo's own timeout, the 30 s deadline above) ends, and
    # close() joins that thread
    assert _both(lambda r: regs[r].close()) == [None, None]


def _allreduce(pg: Any, v: float) -> float:
    t = torch.tensor([v])
    pg.allreduce([t]).wait()
    return float(t.item())


def test_a_group_one_rank_never_made_is_named_at_once() -> None:
    store = dist.HashStore()
    regs = _pair(store)
    regs[0].create([0, 1], None, group_name="1")
    regs[1].create([0, 1], None, group_name="1")
    regs[0].create([0, 1], None, group_name="2")  # rank 1 never makes #2
    t0 = time.monotonic()
    res = _both(lambda r: regs[r].configure(0, store, time.monotonic() + 30, None))
    # both ranks name it (rank 1 from rank 0's list), before any group forms: not waited out
    assert time.monotonic() - t0 < 25
    for r in range(2):
        assert isinstance(res[r], GroupsDisagree), res
        assert "#2 over ranks [0, 1] was made by ranks [0] but not by ranks [1]" in str(res[r])
    for reg in regs:
        reg.abort("done")
        reg.close()


def test_the_pinned_torch_hands_new_group_to_the_default_group() -> None:
    # everything here rests on it: a torch that makes the group itself bypasses the job
    assert torch_delegates_new_group(), torch.__version__


def test_new_group_under_init_run_plainly(tmp_path: Path) -> None:
    # a world of one: torch hands new_group to the job's default group, which forms it at once
    code = (
        "import datetime, torch, torch.distributed as dist, checkpointless as cl\n"
        "from checkpointless.comm.process_group import ResilientProcessGroup\n"
        "job = cl.init()\n"
        "g = dist.new_group(backend='gloo', timeout=datetime.timedelta(days=10000))\n"
        "assert isinstance(g, ResilientProcessGroup) and dist.get_backend(g) == 'gloo', g\n"
        "t = torch.ones(2); dist.all_reduce(t, group=g); g.monitored_barrier(); dist.barrier(group=g)\n"
        "sub, subs = dist.new_subgroups(1)\n"
        "assert isinstance(sub, ResilientProcessGroup) and subs == [sub] and sub.rank() == 0\n"
        "dist.destroy_process_group(g)\n"
        "print('ok', g.group_name, sub.group_name)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["ok", "1", "2"], p.stdout
    assert "terminate called" not in p.stderr, p.stderr[-2000:]
