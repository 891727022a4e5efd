"""Peer state transfer throughput versus raw loopback TCP, measured in the same run.

Two processes on loopback. For every state size (10 MB ... 2 GB) and repeat, in turn:

* raw TCP: the sender writes the same number of bytes on one socket (``sendall``), the receiver
  reads them into a buffer already paged in (``recv_into``) -- the ceiling for any transport here;
* checkpointless: ``checkpointless.state.transfer.send_state`` / ``receive_state`` over a
  ``checkpointless.comm.communicator.Communicator`` (a gloo process group), sending a tree shaped
  like model + AdamW state (float32 tensors, a few small values).

The state transfer is reported two ways: *wire* -- from the moment the sender finished encoding to
the moment the receiver holds every byte (what the transport achieves), and *end to end* -- from
the sender's call (encode: copy into one buffer + checksum) to the receiver's verified, decoded tree
(checksum recomputed, tensors rebuilt). Both processes read the same monotonic clock.

    .venv/bin/python benchmarks/transfer.py            # 10 MB, 100 MB, 1 GB, 2 GB x 5 repeats (~2 min)
    .venv/bin/python benchmarks/transfer.py --quick    # 10 MB, 100 MB x 2 repeats
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9}
MODES = ("replica", "spare", "fresh", "gloo")


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    if t and t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


def human(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:g} {unit}" if n % div == 0 else f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# -- the two worker processes ------------------------------------------------------------------
def make_state(nbytes: int, seed: int = 0) -> Any:
    """A tree like a model's and AdamW's state_dicts adding up to about ``nbytes`` of float32."""
    import torch

    per_group = max(1, nbytes // 3 // 4)  # elements in params, exp_avg, exp_avg_sq each
    chunk = 16 * 1024 * 1024  # at most 64 MB per tensor, like a large layer
    sizes = [chunk] * (per_group // chunk) + ([per_group % chunk] if per_group % chunk else [])
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.rand(n, generator=g) for i, n in enumerate(sizes)}
    state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.rand(n, generator=g),
            "exp_avg_sq": torch.rand(n, generator=g),
        }
        for i, n in enumerate(sizes)
    }
    groups = [{"lr": 3e-3, "betas": (0.9, 0.999), "weight_decay": 0.1, "params": list(range(len(sizes)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 10}


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from checkpointless.comm.communicator import Communicator
    from checkpointless.rendezvous import KeyServer
    from checkpointless.state.transfer import Arena, StreamRoute, receive_state, send_state

    rank = a.worker
    limit = datetime.timedelta(seconds=a.op_timeout)
    store = dist.TCPStore("127.0.0.1", a.port, 2, rank == 0, timeout=limit)
    comm = Communicator(rank, 2, limit)
    comm.rebuild(0, dist.PrefixStore("gen0/", store), rank, 2, time.monotonic() + a.op_timeout)
    # the key server each worker runs under the root-less rendezvous: the stream transport's door
    secret = b"transfer-benchmark-secret"
    server = KeyServer("127.0.0.1", 0, secret)
    server.start()
    store.set(f"ks{rank}", server.address)
    peers = [store.get(f"ks{r}").decode() for r in range(2)]

    def route(name: str) -> StreamRoute:
        return StreamRoute(server, peers, secret, name)

    # the raw socket: the receiver listens, the sender connects
    if rank == 1:
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        store.set("tcp_port", str(lsock.getsockname()[1]))
        sock, _ = lsock.accept()
        lsock.close()
    else:
        port = int(store.get("tcp_port").decode())
        sock = socket.create_connection(("127.0.0.1", port), timeout=a.op_timeout)
    sock.settimeout(a.op_timeout)

    # warm-up, not timed: TCP slow start on the raw socket, first use of gloo's pairs and hashing
    warm = torch.full((8 << 20,), 1, dtype=torch.uint8)
    wview = memoryview(warm.numpy()).cast("B")
    if rank == 0:
        sock.sendall(wview)
        send_state(comm, {"w": torch.zeros(1 << 20)}, [1], a.op_timeout)
    else:
        got = 0
        while got < len(wview):
            got += sock.recv_into(wview[got:], len(wview) - got)
        receive_state(comm, 0, a.op_timeout)
    del wview, warm

    records: list[dict[str, Any]] = []
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    for size in sizes:
        tree = make_state(size) if rank == 0 else None
        # the receiver's own state of the same shape (other values), paged in as a live one is
        replica = make_state(size, seed=1) if rank == 1 else None
        for rep in range(a.repeats):
            rec: dict[str, Any] = {"size": size, "repeat": rep, "rank": rank}
            # raw TCP into a buffer already in memory (the socket's ceiling), then into a fresh
            # buffer (what a receiver that allocates per transfer also pays: page faults)
            for label, paged_in in (("tcp", True), ("tcpfresh", False)):
                buf = torch.empty(size, dtype=torch.uint8)
                if rank == 0 or paged_in:
                    buf.fill_(7 if rank == 0 else 0)
                view = memoryview(buf.numpy()).cast("B")
                comm.barrier(a.op_timeout)
                if rank == 0:
                    rec[f"{label}_start"] = time.monotonic()
                    sock.sendall(view)
                else:
                    got = 0
                    while got < size:
                        n = sock.recv_into(view[got:], size - got)
                        if n == 0:
                            raise ConnectionError("raw TCP sender closed early")
                        got += n
                    rec[f"{label}_done"] = time.monotonic()
                del view, buf
                gc.collect()
            # gloo point-to-point over the same Communicator, into a paged-in buffer: the
            # transport's own ceiling, without encoding, checksums or allocation
            buf = torch.empty(size, dtype=torch.uint8)
            buf.fill_(7 if rank == 0 else 0)
            comm.barrier(a.op_timeout)
            if rank == 0:
                rec["p2p_start"] = time.monotonic()
                comm.wait(comm.send(buf, 1, 9000), a.op_timeout)
            else:
                comm.wait(comm.recv(buf, 0, 9000), a.op_timeout)
                rec["p2p_done"] = time.monotonic()
            del buf
            gc.collect()
            # the state transfer: over the stream (the default transport) into a replica that
            # holds the same tensors (a survivor that fell behind, a spare with its model and
            # optimizer built), into a spare's model plus its paged-in arena, and into nothing;
            # then over the gloo group into the replica
            for mode in MODES:
                into: Any = {"replica": replica, "gloo": replica}.get(mode)
                arena = None
                if mode == "spare" and rank == 1:
                    # a promoted spare: its model exists, its optimizer has no state yet, and it
                    # paged in room for the state while it waited (so before the timing starts)
                    into = {"model": replica["model"]}
                    t_arena = time.monotonic()
                    arena = Arena(int(size * 1.01) + (1 << 20))
                    rec["spare_arena_s"] = time.monotonic() - t_arena
                comm.barrier(a.op_timeout)
                via = None if mode == "gloo" else route(f"state/{size}/{rep}/{mode}")
                rec[f"{mode}_call"] = time.monotonic()
                if rank == 0:
                    info = send_state(comm, tree, [1], a.op_timeout, via)
                    rec.update({f"{mode}_{k}": float(v) for k, v in info.items()})
                else:
                    got_tree, stats = receive_state(comm, 0, a.op_timeout, into, via, arena)
                    rec[f"{mode}_done"] = time.monotonic()
                    rec.update({f"{mode}_{k}": float(v) for k, v in stats.items()})
                    first = got_tree["model"]["layer0.weight"]
                    rec[f"{mode}_check"] = float(first[:4].sum())  # the sender compares (outside the timing)
                    del got_tree, first, arena
                gc.collect()
            comm.barrier(a.op_timeout)
            records.append(rec)
            if rank == 0:  # one byte per finished round, for the driver's bar (outside every timing)
                with open(Path(a.out_dir, "rounds-done"), "ab") as done:
                    done.write(b".")
        if rank == 0 and tree is not None:
            rec0 = tree["model"]["layer0.weight"]
            for r in records:
                if r["size"] == size:
                    r["expect"] = float(rec0[:4].sum())
        del tree, replica
        gc.collect()
    sock.close()
    Path(a.out_dir, f"worker-{rank}.json").write_text(json.dumps(records))
    comm.barrier(a.op_timeout)
    os._exit(0)  # skip interpreter teardown of the gloo threads


# -- the driver --------------------------------------------------------------------------------


def merge(recs0: list[dict[str, Any]], recs1: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_key = {(r["size"], r["repeat"]): r for r in recs1}
    out = []
    for s in recs0:
        r = by_key[(s["size"], s["repeat"])]
        tcp_s = r["tcp_done"] - s["tcp_start"]
        row: dict[str, Any] = {
            "size": s["size"],
            "repeat": s["repeat"],
            "tcp_s": tcp_s,
            "tcp_gbps": s["size"] / tcp_s / 1e9,
            "tcp_fresh_gbps": s["size"] / (r["tcpfresh_done"] - s["tcpfresh_start"]) / 1e9,
            "p2p_gbps": s["size"] / (r["p2p_done"] - s["p2p_start"]) / 1e9,
        }
        for m in MODES:
            nbytes = r[f"{m}_bytes"]
            # wire: the sender's first message posted -> the receiver holds every byte
            wire_s = (r[f"{m}_call"] + r[f"{m}_recv_s"]) - (s[f"{m}_call"] + s[f"{m}_layout_s"])
            e2e_s = r[f"{m}_done"] - s[f"{m}_call"]
            row.update(
                {
                    f"{m}_bytes": nbytes,
                    f"{m}_layout_s": s[f"{m}_layout_s"],
                    f"{m}_wire_s": wire_s,
                    f"{m}_verify_s": r[f"{m}_verify_s"],
                    f"{m}_e2e_s": e2e_s,
                    f"{m}_e2e_gbps": nbytes / e2e_s / 1e9,
                    f"{m}_e2e_pct": 100 * (nbytes / e2e_s) / (s["size"] / tcp_s),
                    f"{m}_in_place_pct": 100 * r[f"{m}_in_place_bytes"] / nbytes,
                    f"{m}_ok": abs(r.get(f"{m}_check", 0.0) - s.get("expect", 0.0)) < 1e-6,
                }
            )
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 MB and 100 MB, 2 repeats")
    ap.add_argument("--sizes", default="10M,100M,1G,2G", help="state sizes (bytes; K/M/G = 10^3/10^6/10^9)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--op-timeout", type=float, default=300.0, help="limit for one transfer, seconds")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="limit for the whole measurement")
    ap.add_argument("--out", help="JSON output (default results/transfer.json; --quick: transfer-quick.json)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a)
        return 0
    if a.quick:
        a.sizes, a.repeats = "10M,100M", 2
    if a.out is None:
        a.out = str(bl.RESULTS / ("transfer-quick.json" if a.quick else "transfer.json"))

    notes: list[str] = []
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    # the sender holds the tree and its encoded copy, the receiver the payload and decoded tree
    avail = mem_available()
    fits = [s for s in sizes if 4.5 * s + 1.5e9 <= avail]
    if fits != sizes:
        dropped = [human(s) for s in sizes if s not in fits]
        notes.append(
            f"Sizes {', '.join(dropped)} left out: {human(avail)} of memory available, a size S needs about 4.5 S."
        )
        sizes = fits
    if not sizes:
        print("not enough memory for any size", file=sys.stderr)
        return 1
    a.sizes = ",".join(str(s) for s in sizes)

    cmd = "python benchmarks/transfer.py " + shlex.join(sys.argv[1:])
    info = bl.machine_info()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="cl-bench-transfer-"))
    port = bl.free_port()
    print(f"transfer benchmark: sizes {', '.join(human(s) for s in sizes)}, {a.repeats} repeats", flush=True)
    try:
        with bl.cleanup_on_exit():
            base = [bl.PYTHON, __file__, "--sizes", a.sizes, "--repeats", str(a.repeats)]
            base += ["--op-timeout", str(a.op_timeout), "--port", str(port), "--out-dir", str(tmp)]
            # both workers at once, each bounded by run_command's time limit
            results: dict[int, bl.Finished] = {}

            def go(rank: int) -> None:
                results[rank] = bl.run_command(
                    [*base, "--worker", str(rank)],
                    timeout=a.run_timeout,
                    env=bl.bench_env(threads=2),
                    stdout=tmp / f"worker-{rank}.out",
                    stderr=tmp / f"worker-{rank}.err",
                )

            threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in (0, 1)]
            for th in threads:
                th.start()
            rounds = tmp / "rounds-done"
            with bl.run_bar(len(sizes) * a.repeats, "transfer", unit="round") as bar:
                while any(th.is_alive() for th in threads):
                    for th in threads:
                        th.join(0.2)
                    if rounds.exists():
                        bar.update(rounds.stat().st_size - bar.n)
            failed = {r: f for r, f in results.items() if f.rc != 0}
            if failed or len(results) < 2:
                for r in (0, 1):
                    err = tmp / f"worker-{r}.err"
                    if err.exists():
                        print(f"--- worker {r} stderr:\n{err.read_text()[-3000:]}", file=sys.stderr)
                print(f"a worker failed: {failed}", file=sys.stderr)
                return 1
            recs0 = json.loads((tmp / "worker-0.json").read_text())
            recs1 = json.loads((tmp / "worker-1.json").read_text())
    except KeyboardInterrupt:
        print("interrupted; both workers were stopped", file=sys.stderr)
        return 130
    finally:
        bl.kill_all_started()
        shutil.rmtree(tmp, ignore_errors=True)

    rows_raw = merge(recs0, recs1)
    info["bench_wall_s"] = time.monotonic() - t0
    info["load_note"] = bl.load_note(load0, os.getloadavg())
    per_size = []
    for size in sizes:
        rs = [r for r in rows_raw if r["size"] == size]
        p: dict[str, Any] = {
            "size": size,
            "bytes": rs[0]["replica_bytes"],
            "tcp_gbps": bl.summary([r["tcp_gbps"] for r in rs]),
            "tcp_fresh_buffer_gbps": bl.summary([r["tcp_fresh_gbps"] for r in rs]),
            "gloo_p2p_gbps": bl.summary([r["p2p_gbps"] for r in rs]),
            "content_ok": all(r[f"{m}_ok"] for r in rs for m in MODES),
        }
        for m in MODES:
            for k in ("layout_s", "wire_s", "verify_s", "e2e_s", "e2e_gbps", "e2e_pct", "in_place_pct"):
                p[f"{m}_{k}"] = bl.summary([r[f"{m}_{k}"] for r in rs])
        per_size.append(p)
    headers = [
        "state", "raw TCP GB/s", "TCP, fresh buffer", "gloo p2p GB/s",
        "into replica GB/s", "% of TCP", "into spare GB/s", "% of TCP", "into new memory GB/s", "% of TCP",
        "via gloo GB/s", "% of TCP", "verify tail s", "e2e s (replica)", "e2e s (spare)", "e2e s (new)",
    ]  # fmt: skip
    rows = [
        [
            human(p["size"]),
            bl.fmt_spread(p["tcp_gbps"]),
            bl.fmt_spread(p["tcp_fresh_buffer_gbps"]),
            bl.fmt_spread(p["gloo_p2p_gbps"]),
            bl.fmt_spread(p["replica_e2e_gbps"]),
            bl.fmt_spread(p["replica_e2e_pct"], 0),
            bl.fmt_spread(p["spare_e2e_gbps"]),
            bl.fmt_spread(p["spare_e2e_pct"], 0),
            bl.fmt_spread(p["fresh_e2e_gbps"]),
            bl.fmt_spread(p["fresh_e2e_pct"], 0),
            bl.fmt_spread(p["gloo_e2e_gbps"]),
            bl.fmt_spread(p["gloo_e2e_pct"], 0),
            bl.fmt(p["replica_verify_s"]["median"], 3),
            bl.fmt(p["replica_e2e_s"]["median"], 3),
            bl.fmt(p["spare_e2e_s"]["median"], 3),
            bl.fmt(p["fresh_e2e_s"]["median"], 3),
        ]
        for p in per_size
    ]
    tbl = bl.table(headers, rows)
    big = [p for p in per_size if p["size"] >= 100e6] or per_size
    worst_rep = min(p["replica_e2e_pct"]["median"] for p in big)
    worst_new = min(p["fresh_e2e_pct"]["median"] for p in big)
    worst_spare = min(p["spare_e2e_pct"]["median"] for p in big)
    notes.insert(
        0,
        f"Expected >= 70% of raw TCP, end to end (sender's call -> receiver's verified tree), states >= 100 MB: "
        f"into a replica's own tensors {worst_rep:.0f}% at worst ({'met' if worst_rep >= 70 else 'NOT met'}); "
        f"into a promoted spare (its model, plus its paged-in arena for the optimizer state) {worst_spare:.0f}% "
        f"({'met' if worst_spare >= 70 else 'NOT met'}); "
        f"into newly allocated memory {worst_new:.0f}% ({'met' if worst_new >= 70 else 'NOT met'}). "
        f"Over the gloo group instead of the stream (the fallback with --rendezvous tcp): "
        f"{min(p['gloo_e2e_pct']['median'] for p in big):.0f}%.",
    )
    if not all(p["content_ok"] for p in per_size):
        notes.append("A received tree did not match the sent one.")
    p2p_pct = [100 * p["gloo_p2p_gbps"]["median"] / p["tcp_gbps"]["median"] for p in big]
    fresh_pct = [100 * p["tcp_fresh_buffer_gbps"]["median"] / p["tcp_gbps"]["median"] for p in big]
    notes.append(
        f"Ceilings (states >= 100 MB): gloo point-to-point alone reaches {min(p2p_pct):.0f}-{max(p2p_pct):.0f}% "
        f"of the raw socket; the raw socket into a freshly allocated buffer (a page fault per 4 KiB on first "
        f"touch) {min(fresh_pct):.0f}-{max(fresh_pct):.0f}%. A receiver with nothing to land in pays the same faults."
    )
    notes.append(
        f"Both processes share one {info['nproc']}-core machine: the loopback copy, gloo's I/O threads and the "
        f"hashing compete for its cores. The stream hashes on a helper thread where a process may use 4 or "
        f"more cores, else on the socket's thread (CHECKPOINTLESS_STREAM_HASH="
        f"{os.environ.get('CHECKPOINTLESS_STREAM_HASH') or 'auto'} in this run)."
    )
    print()
    print(tbl)
    print()
    for n in notes:
        print(f"- {n}")
    result = {
        "benchmark": "transfer",
        "command": cmd,
        "machine": info,
        "params": {"sizes": sizes, "repeats": a.repeats},
        "summary": per_size,
        "notes": notes,
        "runs": rows_raw,
    }
    bl.write_json(Path(a.out), result)
    if Path(a.out).resolve() == (bl.RESULTS / "transfer.json").resolve():
        md = [
            "# State transfer throughput versus raw loopback TCP",
            "",
            f"- Command: `{cmd}`",
            f"- Date: {info['date']}; took {info['bench_wall_s'] / 60:.1f} min",
            f"- Machine: {info['cpu_model']}, {info['nproc']} CPUs, {info['mem_total_gib']} GiB; "
            f"Python {info['python']}, torch {info['torch']}",
            f"- Load: {info['load_note']}",
            f"- Source tree: git {info.get('git') or 'unknown'}",
            "- Two processes on 127.0.0.1. Raw TCP: one socket, `sendall` / `recv_into` of the same byte count "
            "into a buffer already paged in. State transfer: `send_state` / `receive_state` over a "
            "`Communicator` (gloo) with a tree shaped like model + AdamW state (float32, tensors of at most 64 MB).",
            "- *raw TCP*: into a paged-in buffer; *TCP, fresh buffer*: into a new allocation; *gloo p2p*: "
            "`Communicator.send/recv` of one paged-in uint8 tensor. *into replica*: over the direct stream "
            "(the default transport), the receiver passes its own state of the same shape (`into=`; what a "
            "survivor that fell behind, or a spare whose model and optimizer exist, holds), so large tensors "
            "land in place; *into spare*: a promoted spare's model, the optimizer state into the arena the spare "
            "paged in while it waited (`Arena`, timed separately); *into new memory*: the same stream, the "
            "receiver has nothing to land in; *via "
            "gloo*: into the replica over the gloo group (the fallback transport). All end to end: sender's "
            "call -> receiver's verified tree (layout, connection, wire, XXH3 of every byte on both sides, "
            "unpack). *verify tail*: what is left after the last byte (digest comparison, unpacking). "
            "GB = 10^9 bytes. Medians [min-max] of repeats; the % columns compare each repeat with the raw TCP "
            "measured just before it.",
            "",
            tbl,
            "",
            "## Notes",
            "",
            *[f"- {n}" for n in notes],
            "",
        ]
        print("\n".join(md))  # the result file is the JSON; BENCHMARKS.md renders from it
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
