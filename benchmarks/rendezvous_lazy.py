"""A recovery's key exchange with gloo's full mesh against its lazy connection, at up to 64 ranks.

Each rank is a thread of this process with its own key server and root-less store (as under the
launcher), and forms its gloo group through the product's ``comm.handle.new_group``; the mode is
``CHECKPOINTLESS_GLOO_CONNECT`` (``full``: gloo's full mesh; ``lazy``: the default). Per mode and
size: generation 0 (start-up), then --recoveries generations in which the last rank is replaced (a
new key server, as a spare process brings its own). Each generation runs what a data-parallel
step needs (an all-reduce) and, with --barrier, a barrier as well. Measured per generation:

* the keys each rank read from the store (``get``/``multi_get``), the requests it sent and the
  requests its key server answered;
* the wall time from the start of forming until every rank has its all-reduce result: with the
  full mesh the key exchange and all N-1 connections happen while the group forms, lazily they
  happen in the first collective, so the comparison includes both.

One process on two shared cores: the ranks' threads share the GIL and the cores, so the times
are this machine's (and the full mesh's N^2 Python requests weigh on it as they would not on N
machines); the key counts are what they would be anywhere, and they are what the goodput model
(simulate/plans.py:lazy_keys_read) takes. Run: ``python benchmarks/rendezvous_lazy.py`` (about a
minute); ``--sizes 8,32`` for a quicker run. Writes benchmarks/results/rendezvous_lazy.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from checkpointless.comm.handle import GLOO_CONNECT_VAR, new_group
from checkpointless.config import ENV
from checkpointless.rendezvous import KeyServer, PeerTable, RootlessStore

RESULTS = Path(__file__).resolve().parent / "results"
SECRET = b"benchmark-secret"
TIMEOUT = datetime.timedelta(seconds=120)


class CountingStore(RootlessStore):
    """The root-less store, counting the keys gloo reads through it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keys_read = 0
        self._count_lock = threading.Lock()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._count_lock:
            self.keys_read += len(keys)
        return super().multi_get(keys)

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]


def _server() -> KeyServer:
    server = KeyServer("127.0.0.1", 0, SECRET)
    server.start()
    return server


def generation(servers: list[KeyServer], gen: int, barrier: bool) -> dict[str, Any]:
    """Form generation ``gen`` on every rank and run its first collectives; what it cost."""
    n = len(servers)
    table = PeerTable([s.address for s in servers])
    served0 = [s.stats.requests for s in servers]
    stores = [CountingStore(r, n, table, SECRET, f"gen{gen}/", TIMEOUT, servers[r]) for r in range(n)]
    done = [0.0] * n
    errors: list[str] = []
    groups: list[Any] = []
    start = threading.Barrier(n + 1)

    def rank_main(r: int) -> None:
        try:
            start.wait()
            pg = new_group("gloo", stores[r], r, n, TIMEOUT)
            groups.append(pg)
            x = torch.ones(16)
            pg.allreduce([x]).wait()
            if barrier:
                pg.barrier().wait()
            done[r] = time.monotonic()
            if float(x[0]) != n:
                errors.append(f"rank {r}: all-reduce gave {float(x[0])}, not {n}")
        except Exception as e:
            errors.append(f"rank {r}: {type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join(TIMEOUT.total_seconds())
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"generation {gen} of {n} ranks failed: {errors[:3]}")
    wall = max(done) - t0
    reads = [s.keys_read for s in stores]
    sent = [s.requests_sent for s in stores]
    served = [s.stats.requests - a for s, a in zip(servers, served0, strict=True)]
    groups.clear()  # gloo's threads are joined here, before the stores go
    return {
        "generation": gen,
        "wall_s": wall,
        "keys_read_max": max(reads),
        "keys_read_mean": statistics.fmean(reads),
        "keys_read_total": sum(reads),
        "requests_sent_max": max(sent),
        "requests_served_max": max(served),
    }


def run_mode(mode: str, n: int, recoveries: int, barrier: bool) -> dict[str, Any]:
    os.environ[GLOO_CONNECT_VAR] = mode
    servers = [_server() for _ in range(n)]
    retired: list[KeyServer] = []
    try:
        gens = [generation(servers, 0, barrier)]
        for gen in range(1, recoveries + 1):
            retired.append(servers[-1])
            servers[-1] = _server()  # the last rank replaced, as by a spare
            gens.append(generation(servers, gen, barrier))
    finally:
        for s in servers + retired:
            s.stop()
    rec = gens[1:]
    return {
        "mode": mode,
        "ranks": n,
        "startup": gens[0],
        "recoveries": rec,
        "recovery_wall_median_s": statistics.median(g["wall_s"] for g in rec),
        "recovery_keys_read_max": max(g["keys_read_max"] for g in rec),
        "recovery_keys_read_total": statistics.median(g["keys_read_total"] for g in rec),
        "recovery_requests_served_max": max(g["requests_served_max"] for g in rec),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,16,32,64", help="rank counts, comma-separated")
    ap.add_argument("--recoveries", type=int, default=3, help="generations with a replaced rank")
    ap.add_argument("--barrier", action="store_true", help="each generation also runs a barrier")
    ap.add_argument("--modes", default="full,lazy", help="gloo connection modes, comma-separated")
    ap.add_argument("--out", type=Path, default=RESULTS / "rendezvous_lazy.json")
    args = ap.parse_args(argv)
    os.environ[ENV.HOST] = "127.0.0.1"  # the launcher's path: gloo bound to the job's host
    os.environ["GLOO_ENABLE_STORE_V2_API"] = "1"  # as the launcher sets it
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    t0 = time.monotonic()
    rows = []
    for n in sizes:
        for mode in args.modes.split(","):
            row = run_mode(mode, n, args.recoveries, args.barrier)
            rows.append(row)
            print(
                f"{mode:4} N={n:4}: a recovery reads {row['recovery_keys_read_max']} keys per rank at most "
                f"({row['recovery_keys_read_total']:.0f} in all), busiest key server answered "
                f"{row['recovery_requests_served_max']} requests, {row['recovery_wall_median_s'] * 1e3:.1f} ms "
                "to the first all-reduce",
                flush=True,
            )
    cmd = " ".join(["python benchmarks/rendezvous_lazy.py", *(argv if argv is not None else sys.argv[1:])])
    out = {
        "command": cmd,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg(),
        },
        "barrier": args.barrier,
        "rows": rows,
        "runtime_s": time.monotonic() - t0,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
