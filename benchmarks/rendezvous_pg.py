"""Real gloo process groups over both stores: start-up, rebuilds, and the loss of rank 0.

For 2 to 8 processes on this machine, each store design forms a ProcessGroupGloo (and checks one
allreduce) for a start-up generation and then several rebuild generations in the same processes.
The last rank arrives ``--late-ms`` after the others, as a replacement does in a recovery, and
the time that counts is from that last arrival until every rank holds the new group.

* ``tcpstore``: torch's TCPStore hosted by rank 0 (the usual ``init_process_group`` set-up),
  one key prefix per generation (a PrefixStore), as a rebuild over a central store must do;
* ``rootless``: a KeyServer per process and a RootlessStore per generation.

Then rank 0 is killed and a new process takes its place: the root-less group rebuilds; the
central one cannot, its store died with rank 0 (the survivors' error and its delay are recorded).

Run: ``python benchmarks/rendezvous_pg.py`` (well under a minute); writes
benchmarks/results/rendezvous_pg.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"
SECRET = b"benchmark-secret"
TIMEOUT = datetime.timedelta(seconds=30)
KINDS = ("tcpstore", "rootless")


def _worker(conn: Connection, kind: str) -> None:
    import torch
    import torch.distributed as dist

    from checkpointless.rendezvous import KeyServer, PeerTable, RootlessStore

    server = KeyServer("127.0.0.1", 0, SECRET) if kind == "rootless" else None
    if server is not None:
        server.start()
    conn.send(server.address if server is not None else "")
    base: Any = None
    # The live generation's group and store. A replaced group is dropped only after the new one
    # works: destroying a gloo group right before a rebuild delayed the rebuild by ~10 ms per peer
    # here (its teardown competes with the new connections), so the core parks old groups too.
    kept: list[Any] = []
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        if cmd[0] == "host":  # rank 0 of the central design hosts the store
            base = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
            conn.send(base.port)
            continue
        if cmd[0] == "connect":
            base = dist.TCPStore(
                "127.0.0.1", cmd[1], is_master=False, wait_for_workers=False, timeout=TIMEOUT
            )
            conn.send("connected")
            continue
        _, gen, rank, n, table_json, timeout_s = cmd
        timeout = datetime.timedelta(seconds=timeout_s)
        parked, kept = kept, []
        t_enter = time.monotonic()
        try:
            if server is not None:
                table = PeerTable.from_json(table_json)
                store: Any = RootlessStore(rank, n, table, SECRET, f"gen{gen}/", timeout, server)
                server.drop_prefix(f"gen{gen - 2}/")
            else:
                store = dist.PrefixStore(f"gen{gen}/", base)
            pg = dist.ProcessGroupGloo(store, rank, n, timeout)
            t_formed = time.monotonic()
            x = torch.ones(1)
            pg.allreduce([x]).wait()
            kept += [store, pg]
            conn.send(("ok", t_enter, t_formed, float(x.item())))
        except Exception as e:
            conn.send(("error", t_enter, time.monotonic(), f"{type(e).__name__}: {e}"[:300]))
        parked.clear()


class Group:
    """``n`` worker processes of one store design."""

    def __init__(self, ctx: Any, kind: str, n: int) -> None:
        self.ctx, self.kind, self.n = ctx, kind, n
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.addresses: list[str] = []
        for _ in range(n):
            self._spawn()
        if kind == "tcpstore":
            self.conns[0].send(("host",))
            port = self.conns[0].recv()
            for c in self.conns[1:]:
                c.send(("connect", port))
                c.recv()

    def _spawn(self, slot: int | None = None) -> None:
        a, b = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(b, self.kind), daemon=True)
        p.start()
        b.close()
        address = a.recv()
        if slot is None:
            self.procs.append(p)
            self.conns.append(a)
            self.addresses.append(address)
        else:
            self.procs[slot], self.conns[slot], self.addresses[slot] = p, a, address

    def table_json(self) -> str:
        return json.dumps({"peers": self.addresses}) if self.kind == "rootless" else ""

    def generation(
        self, gen: int, late_s: float, timeout_s: float, ranks: list[int] | None = None
    ) -> dict[str, Any]:
        """Form generation ``gen``; the last rank is sent in ``late_s`` after the others."""
        ranks = list(range(self.n)) if ranks is None else ranks
        table = self.table_json()
        for r in ranks[:-1]:
            self.conns[r].send(("gen", gen, r, self.n, table, timeout_s))
        time.sleep(late_s)
        last = ranks[-1]
        self.conns[last].send(("gen", gen, last, self.n, table, timeout_s))
        replies = {r: self.conns[r].recv() for r in ranks}
        if any(m[0] != "ok" for m in replies.values()):
            errors = {r: m[3] for r, m in replies.items() if m[0] != "ok"}
            return {"ok": False, "errors": errors}
        assert all(m[3] == float(self.n) for m in replies.values())
        arrival = replies[last][1]
        return {
            "ok": True,
            "from_last_arrival_s": max(m[2] for m in replies.values()) - arrival,
            "from_first_arrival_s": max(m[2] for m in replies.values()) - min(m[1] for m in replies.values()),
        }

    def kill_rank0_and_rebuild(self, gen: int, late_s: float) -> dict[str, Any]:
        """SIGKILL rank 0, start a new process in its place, and try to form ``gen``."""
        os.kill(self.procs[0].pid, signal.SIGKILL)
        self.procs[0].join(10)
        killed = time.monotonic()
        self._spawn(slot=0)
        if self.kind == "tcpstore":
            # The store lived in rank 0 and died with it: the replacement has nothing to join, and
            # the survivors' clients point at a dead port. This is what they get.
            t0 = time.monotonic()
            for r in range(1, self.n):
                self.conns[r].send(("gen", gen, r, self.n, "", 5.0))
            replies = [self.conns[r].recv() for r in range(1, self.n)]
            return {
                "ok": all(m[0] == "ok" for m in replies),
                "survivor_error": next((m[3] for m in replies if m[0] != "ok"), None),
                "error_after_s": max(m[2] for m in replies) - t0,
            }
        result = self.generation(gen, late_s, TIMEOUT.total_seconds(), ranks=[*range(1, self.n), 0])
        result["replacement_ready_after_kill_s"] = time.monotonic() - killed
        return result

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs, strict=True):
            if p.is_alive():
                c.send(("stop",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _ms(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (seconds), in milliseconds."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e3


def run(
    ctx: Any, kind: str, n: int, rebuilds: int, late_s: float, repeats: int, bar: tqdm[Any]
) -> dict[str, Any]:
    """``repeats`` fresh groups: each a start-up, ``rebuilds`` rebuilds, then rank 0 replaced."""
    startups, rebuilt, replaced = [], [], []
    for _ in range(repeats):
        g = Group(ctx, kind, n)
        try:
            startups.append(g.generation(0, late_s, TIMEOUT.total_seconds()))
            rebuilt += [g.generation(gen, late_s, TIMEOUT.total_seconds()) for gen in range(1, rebuilds + 1)]
            replaced.append(g.kill_rank0_and_rebuild(rebuilds + 1, late_s))
        finally:
            g.close()
        bar.update()
    up = [r["from_last_arrival_s"] for r in startups if r["ok"]]
    times = [r["from_last_arrival_s"] for r in rebuilt if r["ok"]]
    row: dict[str, Any] = {
        "store": kind,
        "ranks": n,
        "startups": startups,
        "rebuilds": rebuilt,
        "rank0_replaced": replaced,
        "failed_generations": sum(not r["ok"] for r in [*startups, *rebuilt]),
        "startup_median_ms": _ms(up, 0.5),
        "rebuild_median_ms": _ms(times, 0.5),
        "rebuild_p90_ms": _ms(times, 0.9),
        "rebuild_max_ms": _ms(times, 1.0),
    }
    ok = [r["from_last_arrival_s"] for r in replaced if r["ok"]]
    row["rank0_replaced_summary"] = (
        f"rebuilt, median {_ms(ok, 0.5):.1f} ms after the replacement arrived ({len(ok)}/{repeats})"
        if ok
        else f"no rebuild ({repeats}/{repeats}): survivors got {replaced[0].get('survivor_error')} "
        f"after {max(r['error_after_s'] for r in replaced):.2f} s at most"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes", default="2,4,8", help="processes per group (comma-separated)")
    ap.add_argument("--rebuilds", type=int, default=10, help="rebuild generations after start-up")
    ap.add_argument("--repeats", type=int, default=3, help="fresh groups per store and size")
    ap.add_argument("--late-ms", type=float, default=50.0, help="how late the last rank arrives")
    ap.add_argument(
        "--unbatched", action="store_true", help="gloo's default wait+get reads instead of multi_get"
    )
    ap.add_argument("--out", default=str(RESULTS / "rendezvous_pg.json"))
    args = ap.parse_args(argv)
    # gloo reads these in every process at every rendezvous; the workers inherit them.
    os.environ["GLOO_ENABLE_STORE_V2_API"] = "0" if args.unbatched else "1"
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "checkpointless.rendezvous"])
    t_start = time.monotonic()
    load_at_start = os.getloadavg()
    rows = []
    sizes = [int(x) for x in args.sizes.split(",")]
    # a bar over the groups formed, on stderr and only on a terminal; stdout and the JSON are unchanged
    with tqdm(
        total=len(sizes) * len(KINDS) * args.repeats,
        desc="rendezvous_pg",
        unit="group",
        disable=None,
        leave=False,
    ) as bar:
        for n in sizes:
            for kind in KINDS:
                rows.append(run(ctx, kind, n, args.rebuilds, args.late_ms / 1000, args.repeats, bar))
                r = rows[-1]
                tqdm.write(
                    f"{kind:9s} n={n}: start-up {r['startup_median_ms']:.1f} ms, "
                    f"rebuild {r['rebuild_median_ms']:.1f} ms"
                )
    doc = {
        "command": " ".join(
            ["python benchmarks/rendezvous_pg.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "gloo_store_v2_api": os.environ["GLOO_ENABLE_STORE_V2_API"],
        "late_ms": args.late_ms,
        "machine": {
            "nproc": os.cpu_count(),
            "load_avg_at_start": load_at_start,
            "load_avg_at_end": os.getloadavg(),
        },
        "rows": rows,
        "runtime_s": time.monotonic() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(
        "\nranks | store | start-up ms (median) | rebuild ms: median | p90 | max | rank 0 killed, new process in its place"
    )
    print("---: | --- | ---: | ---: | ---: | ---: | ---")
    for r in rows:
        print(
            f"{r['ranks']} | {r['store']} | {r['startup_median_ms']:.1f} | {r['rebuild_median_ms']:.1f} | "
            f"{r['rebuild_p90_ms']:.1f} | {r['rebuild_max_ms']:.1f} | {r['rank0_replaced_summary']}"
        )
    print(
        f"\n(times from the last rank's arrival, {args.late_ms:.0f} ms after the others; {args.repeats} x {args.rebuilds} rebuilds each; ran {doc['runtime_s']:.0f} s)"
    )
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
