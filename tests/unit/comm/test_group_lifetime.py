"""A group's life is its users', never its collectives' (comm/generations.py).

A collective's completion runs on gloo's own worker thread (``Handle.on_done``, which DDP's
bucket futures use). Had a handle held its group, a process that let go of the group while that
thread was still finishing the last collective (a replacement's DDP returning from its first
step) dropped the group's last reference there, and ``~ProcessGroupGloo`` joined the very
thread it ran on: ``std::system_error: Resource deadlock avoided``, then SIGABRT: 3 runs in 18 of
the peer-lost-mid-backward DDP test (tests/unit/comm/test_torch_ddp.py) on two cores at load 5-6.
"""

from __future__ import annotations

import datetime
import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

from checkpointless.comm.handle import Handle
from checkpointless.comm.process_group import ResilientProcessGroup
from tests.helpers.ranks import spawn_ranks

pytestmark = pytest.mark.timeout(60)

TIMEOUT = datetime.timedelta(seconds=30)


def test_a_collectives_handle_does_not_keep_its_group_alive() -> None:
    pg = ResilientProcessGroup(0, 1, (0,), TIMEOUT)
    pg.configure(0, dist.HashStore(), deadline=time.monotonic() + 10)
    handle = pg.allreduce([torch.ones(4)]).handle
    gone = weakref.ref(pg)
    del pg
    gc.collect()
    assert gone() is None, "a handle held its group"
    handle.wait(10)  # its collective still completes; a group gone has nothing to forget


def _let_go_while_gloo_finishes(rank: int, port: int) -> dict[str, Any]:
    """Rank 0 drops its group while gloo's thread runs the last collective's completion."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    pg = ResilientProcessGroup(rank, 2, range(2), TIMEOUT)
    pg.configure(0, dist.PrefixStore("g", store), deadline=time.monotonic() + 30)
    if rank == 1:
        store.wait(["listening"])  # rank 0's all-reduce completes only now, on gloo's thread
        pg.allreduce([torch.ones(4)]).wait(TIMEOUT)
        store.wait(["done"])
        pg.close()
        return {}
    running, letting_go = threading.Event(), threading.Event()
    where: list[bool] = []

    def late(_: Handle) -> None:
        where.append(threading.current_thread() is threading.main_thread())
        running.set()
        letting_go.wait(10)
        time.sleep(1)  # the main thread drops the group meanwhile

    work = pg.allreduce([torch.ones(4)])
    work.handle.on_done(late)
    store.set("listening", "1")
    assert running.wait(30), "the all-reduce never completed"
    gone = weakref.ref(pg)
    letting_go.set()
    del pg, work  # the last references this process holds: the group ends here, not on gloo's thread
    time.sleep(1.5)  # gloo's thread leaves its callback (where the group once ended, aborting us)
    store.set("done", "1")
    return {"on_main": where, "gone": gone() is None}


@pytest.mark.timeout(150)  # the first spawn starts the fork server: ~30 s of imports at load 15
def test_a_group_let_go_while_gloo_finishes_its_collective_ends_on_the_main_thread() -> None:
    res = spawn_ranks(_let_go_while_gloo_finishes, 2, (), timeout=120, what="let go")
    assert res[0] == {"on_main": [False], "gone": True}, res[0]
