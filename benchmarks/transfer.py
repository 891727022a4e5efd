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
import benchlib as bl

_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9}


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
def make_state(nbytes: int) -> Any:
    """A tree like a model's and AdamW's state_dicts adding up to about ``nbytes`` of float32."""
    import torch

    per_group = max(1, nbytes // 3 // 4)  # elements in params, exp_avg, exp_avg_sq each
    chunk = 16 * 1024 * 1024  # at most 64 MB per tensor, like a large layer
    sizes = [chunk] * (per_group // chunk) + ([per_group % chunk] if per_group % chunk else [])
    g = torch.Generator().manual_seed(0)
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
    from checkpointless.state.transfer import receive_state, send_state

    rank = a.worker
    limit = datetime.timedelta(seconds=a.op_timeout)
    store = dist.TCPStore("127.0.0.1", a.port, 2, rank == 0, timeout=limit)
    comm = Communicator(rank, 2, limit)
    comm.rebuild(0, dist.PrefixStore("gen0/", store), rank, 2, time.monotonic() + a.op_timeout)

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
            comm.barrier(a.op_timeout)
            # the state transfer
            rec["call"] = time.monotonic()
            if rank == 0:
                info = send_state(comm, tree, [1], a.op_timeout)
                rec.update({k: float(v) for k, v in info.items()})
            else:
                got_tree, stats = receive_state(comm, 0, a.op_timeout)
                rec["done"] = time.monotonic()
                rec.update({k: float(v) for k, v in stats.items()})
                first = got_tree["model"]["layer0.weight"]
                rec["check"] = float(first[:4].sum())  # the sender compares (outside the timing)
                del got_tree, first
            gc.collect()
            comm.barrier(a.op_timeout)
            records.append(rec)
        if rank == 0 and tree is not None:
            rec0 = tree["model"]["layer0.weight"]
            for r in records:
                if r["size"] == size:
                    r["expect"] = float(rec0[:4].sum())
        del tree
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
        nbytes = r["bytes"]
        tcp_s = r["tcp_done"] - s["tcp_start"]
        fresh_s = r["tcpfresh_done"] - s["tcpfresh_start"]
        p2p_s = r["p2p_done"] - s["p2p_start"]
        encode_end = s["call"] + s["encode_s"]
        wire_s = (r["call"] + r["recv_s"]) - encode_end
        e2e_s = r["done"] - s["call"]
        out.append(
            {
                "size": s["size"],
                "repeat": s["repeat"],
                "bytes": nbytes,
                "tcp_s": tcp_s,
                "tcp_gbps": s["size"] / tcp_s / 1e9,
                "tcp_fresh_gbps": s["size"] / fresh_s / 1e9,
                "p2p_gbps": s["size"] / p2p_s / 1e9,
                "encode_s": s["encode_s"],
                "send_s": s["send_s"],
                "wire_s": wire_s,
                "wire_gbps": nbytes / wire_s / 1e9,
                "verify_decode_s": r["verify_s"],
                "e2e_s": e2e_s,
                "e2e_gbps": nbytes / e2e_s / 1e9,
                "content_ok": abs(r.get("check", 0.0) - s.get("expect", 0.0)) < 1e-6,
            }
        )
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
            while any(th.is_alive() for th in threads):
                for th in threads:
                    th.join(0.2)
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
        tcp = bl.summary([r["tcp_gbps"] for r in rs])
        fresh = bl.summary([r["tcp_fresh_gbps"] for r in rs])
        p2p = bl.summary([r["p2p_gbps"] for r in rs])
        wire = bl.summary([r["wire_gbps"] for r in rs])
        e2e = bl.summary([r["e2e_gbps"] for r in rs])
        # each repeat's state transfer against the TCP measured right before it
        wire_pct = bl.summary([100 * r["wire_gbps"] / r["tcp_gbps"] for r in rs])
        e2e_pct = bl.summary([100 * r["e2e_gbps"] / r["tcp_gbps"] for r in rs])
        per_size.append(
            {
                "size": size,
                "bytes": rs[0]["bytes"],
                "tcp_gbps": tcp,
                "tcp_fresh_buffer_gbps": fresh,
                "gloo_p2p_gbps": p2p,
                "wire_gbps": wire,
                "e2e_gbps": e2e,
                "wire_pct_of_tcp": wire_pct,
                "e2e_pct_of_tcp": e2e_pct,
                "encode_s": bl.summary([r["encode_s"] for r in rs]),
                "wire_s": bl.summary([r["wire_s"] for r in rs]),
                "verify_decode_s": bl.summary([r["verify_decode_s"] for r in rs]),
                "e2e_s": bl.summary([r["e2e_s"] for r in rs]),
                "content_ok": all(r["content_ok"] for r in rs),
            }
        )
    headers = [
        "state", "raw TCP GB/s", "TCP, fresh buffer", "gloo p2p GB/s", "state wire GB/s", "wire % of TCP",
        "end-to-end GB/s", "e2e % of TCP", "encode s", "wire s", "verify+decode s", "e2e s",
    ]  # fmt: skip
    rows = [
        [
            human(p["size"]),
            bl.fmt_spread(p["tcp_gbps"]),
            bl.fmt_spread(p["tcp_fresh_buffer_gbps"]),
            bl.fmt_spread(p["gloo_p2p_gbps"]),
            bl.fmt_spread(p["wire_gbps"]),
            bl.fmt_spread(p["wire_pct_of_tcp"], 0),
            bl.fmt_spread(p["e2e_gbps"]),
            bl.fmt_spread(p["e2e_pct_of_tcp"], 0),
            bl.fmt(p["encode_s"]["median"], 3),
            bl.fmt(p["wire_s"]["median"], 3),
            bl.fmt(p["verify_decode_s"]["median"], 3),
            bl.fmt(p["e2e_s"]["median"], 3),
        ]
        for p in per_size
    ]
    tbl = bl.table(headers, rows)
    big = [p for p in per_size if p["size"] >= 100e6] or per_size
    worst_wire = min(p["wire_pct_of_tcp"]["median"] for p in big)
    worst_e2e = min(p["e2e_pct_of_tcp"]["median"] for p in big)
    notes.insert(
        0,
        f"Expected >= 70% of raw TCP: wire-only {worst_wire:.0f}% at worst for states >= 100 MB "
        f"({'met' if worst_wire >= 70 else 'NOT met'}); end to end, with encode and checksum "
        f"verification, {worst_e2e:.0f}% ({'met' if worst_e2e >= 70 else 'NOT met'}).",
    )
    if not all(p["content_ok"] for p in per_size):
        notes.append("A received tree did not match the sent one.")
    p2p_pct = [100 * p["gloo_p2p_gbps"]["median"] / p["tcp_gbps"]["median"] for p in big]
    fresh_pct = [100 * p["tcp_fresh_buffer_gbps"]["median"] / p["tcp_gbps"]["median"] for p in big]
    notes.append(
        f"Where the wire time goes (states >= 100 MB): gloo point-to-point alone reaches "
        f"{min(p2p_pct):.0f}-{max(p2p_pct):.0f}% of the raw socket; the same socket into a freshly allocated "
        f"buffer (page faults on first touch) {min(fresh_pct):.0f}-{max(fresh_pct):.0f}%. receive_state "
        "allocates a new payload buffer for every transfer, so it pays both."
    )
    notes.append(
        "Both processes share one 2-core machine (with other work): the loopback copy, gloo's I/O threads and "
        "the checksum threads compete for the same cores."
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
            "into a buffer already paged in (the state transfer allocates and faults in its own). State transfer: `send_state` / `receive_state` over a `Communicator` (gloo) "
            "with a tree shaped like model + AdamW state (float32, tensors of at most 64 MB).",
            "- *raw TCP*: into a paged-in buffer; *TCP, fresh buffer*: into a new allocation; *gloo p2p*: "
            "`Communicator.send/recv` of one paged-in uint8 tensor. *wire*: sender done encoding -> receiver holds every byte. *end to end*: sender's call -> "
            "receiver's verified, decoded tree (encode = copy into one buffer + checksum; verify = checksum "
            "again + tensors rebuilt). GB = 10^9 bytes. Medians [min-max] of repeats; the % columns compare "
            "each repeat with the raw TCP measured just before it.",
            "",
            tbl,
            "",
            "## Notes",
            "",
            *[f"- {n}" for n in notes],
            "",
        ]
        (bl.RESULTS / "transfer.md").write_text("\n".join(md))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
