"""Root-less rendezvous with real processes: gloo process groups over RootlessStore, generation
after generation, and SIGKILL of a participant (rank 0 included) in the middle of a rendezvous.

Workers are forked from a forkserver that imported torch once, so a process costs milliseconds
instead of an ``import torch``; each one is still a separate process with its own key server,
killed with a real SIGKILL.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from checkpointless.rendezvous import KeyServer, PeerTable, open_listener

SECRET = b"process-test-secret"
WORLD = 4
EXPECTED_SUM = [float(sum(range(1, WORLD + 1)))] * 3  # every rank contributes rank + 1
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "torch.distributed", "checkpointless.rendezvous"])


def _worker(conn: Connection, secret: bytes, listener: socket.socket | None) -> None:
    """One participant: a key server for its whole life, one gloo group per generation."""
    import torch
    import torch.distributed as dist

    from checkpointless.errors import RendezvousError
    from checkpointless.rendezvous import RootlessStore

    if listener is None:
        server = KeyServer("127.0.0.1", 0, secret)
    else:
        server = KeyServer("127.0.0.1", 0, secret, listen_fd=listener.detach())
    server.start()
    conn.send(("ready", server.address))
    kept: list[Any] = []  # the live generation's store and group (the group needs its store)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            server.stop()
            return
        _, gen, rank, table_json, batched = cmd
        # gloo reads this at every rendezvous: batched multi_get (1) or wait+get per rank (0).
        os.environ["GLOO_ENABLE_STORE_V2_API"] = "1" if batched else "0"
        server.drop_prefix(f"gen{gen - 2}/")  # every rank left gen-2 long ago
        table = PeerTable.from_json(table_json)
        t0 = time.monotonic()
        timeout = datetime.timedelta(seconds=20)
        kept.clear()
        try:
            store = RootlessStore(
                rank, len(table), table, secret, f"gen{gen}/", timeout, server,
                connect_grace=datetime.timedelta(seconds=2),
            )  # fmt: skip
            pg = dist.ProcessGroupGloo(store, rank, len(table), timeout)
            t = torch.full((3,), float(rank + 1))
            pg.allreduce([t]).wait()
            kept += [store, pg]
            conn.send(("ok", gen, t.tolist(), time.monotonic() - t0))
        except RendezvousError as e:
            conn.send(("rendezvous-error", gen, str(e), time.monotonic()))
        except Exception as e:
            conn.send(("other-error", gen, repr(e), time.monotonic()))


class Worker:
    def __init__(self, listener: socket.socket | None = None) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_worker, args=(child, SECRET, listener), daemon=True)
        self.proc.start()
        child.close()
        if listener is not None:
            listener.close()  # the child has its own copy; ours must not keep the port alive
        self.address = ""

    def wait_ready(self) -> None:
        assert self.conn.poll(60), "worker did not start"
        tag, self.address = self.conn.recv()
        assert tag == "ready"

    def reply(self, timeout: float) -> tuple[Any, ...]:
        assert self.conn.poll(timeout), "worker did not answer in time"
        msg: tuple[Any, ...] = self.conn.recv()
        return msg


@pytest.fixture
def spawn() -> Iterator[Any]:
    started: list[Worker] = []

    def make(n: int, listener: socket.socket | None = None) -> list[Worker]:
        ws = [Worker(listener) for _ in range(n)]
        started.extend(ws)
        return ws

    yield make
    for w in started:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(10)
        w.conn.close()


def _start_rendezvous(ranks: dict[int, Worker], gen: int, table: PeerTable, batched: bool) -> None:
    for rank, w in ranks.items():
        w.conn.send(("rdzv", gen, rank, table.to_json(), batched))


def _rendezvous(ranks: dict[int, Worker], gen: int, table: PeerTable, batched: bool) -> list[float]:
    """Run one generation on every worker; check its allreduce; return each rank's time."""
    _start_rendezvous(ranks, gen, table, batched)
    times = []
    for rank, w in ranks.items():
        msg = w.reply(40)
        assert msg[:2] == ("ok", gen), f"rank {rank}: {msg}"
        assert msg[2] == EXPECTED_SUM
        times.append(msg[3])
    return times


@pytest.mark.timeout(90)
def test_startup_and_three_rebuilds_of_a_gloo_group(spawn: Any) -> None:
    workers = spawn(WORLD)
    for w in workers:
        w.wait_ready()
    table = PeerTable([w.address for w in workers])
    ranks = dict(enumerate(workers))
    for gen in range(4):  # start-up, then three rebuilds; both of gloo's read paths
        times = _rendezvous(ranks, gen, table, batched=gen % 2 == 0)
        if gen > 0:
            assert max(times) < 5.0, times
    for w in workers:
        w.conn.send(("stop",))
        w.proc.join(10)
        assert w.proc.exitcode == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 2])
def test_sigkill_mid_rendezvous_fails_fast_and_the_next_generation_forms(spawn: Any, victim: int) -> None:
    workers = spawn(WORLD)
    for w in workers:
        w.wait_ready()
    table = PeerTable([w.address for w in workers])
    _rendezvous(dict(enumerate(workers)), 0, table, batched=True)

    # Generation 1: every rank but the victim has published its address and is reading the
    # others'; the victim's server holds their requests for its key when it is killed.
    survivors = {r: w for r, w in enumerate(workers) if r != victim}
    batched = victim == 0
    _start_rendezvous(survivors, 1, table, batched)
    time.sleep(0.5)
    assert not any(w.conn.poll(0) for w in survivors.values()), "survivors finished without the victim"
    killed_at = time.monotonic()
    os.kill(workers[victim].proc.pid, signal.SIGKILL)
    for rank, w in survivors.items():
        tag, gen, message, failed_at = w.reply(15)
        assert (tag, gen) == ("rendezvous-error", 1), f"rank {rank}: {message}"
        assert f"rank {victim} ({table[victim]})" in message
        assert failed_at - killed_at < 3.0, f"rank {rank} took {failed_at - killed_at:.2f} s: {message}"
    workers[victim].proc.join(10)

    # Generation 2: a replacement takes the victim's rank. For victim 0 the survivors start the
    # rendezvous before the replacement exists: its port, bound here first, holds their
    # requests until it serves them.
    listener = open_listener("127.0.0.1", 0) if victim == 0 else None
    if listener is not None:
        table = table.replace(victim, f"127.0.0.1:{listener.getsockname()[1]}")
        _start_rendezvous(survivors, 2, table, batched)
        (replacement,) = spawn(1, listener)
        replacement.wait_ready()
    else:
        (replacement,) = spawn(1)
        replacement.wait_ready()
        table = table.replace(victim, replacement.address)
        _start_rendezvous(survivors, 2, table, batched)
    arrived = time.monotonic()
    _start_rendezvous({victim: replacement}, 2, table, batched)
    everyone = {**survivors, victim: replacement}
    for rank in sorted(everyone):
        msg = everyone[rank].reply(40)
        assert msg[:2] == ("ok", 2) and msg[2] == EXPECTED_SUM, f"rank {rank}: {msg}"
    assert time.monotonic() - arrived < 5.0
    # And the group keeps rebuilding with the replacement in it.
    _rendezvous(dict(sorted(everyone.items())), 3, table, batched=not batched)
