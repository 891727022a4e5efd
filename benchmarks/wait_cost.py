"""CPU that a rank spends waiting on a gloo collective whose peer is late, three ways.

Two processes, one gloo group; each round, rank 1 joins an all-reduce ``--late-ms`` after rank 0
issued it, and rank 0's process CPU over the wait is read (``time.process_time``: the waiting
thread and gloo's own threads, so a callback on gloo's thread is counted):

* ``blocking``: torch's ``work.wait()`` (what plain torch does; cannot be woken by an abort);
* ``slices``: bounded 10 ms ``work.wait(timeout)`` calls until it completes, each timeout ending
  in c10d's error: what checkpointless's :class:`~checkpointless.comm.handle.Handle` does (it
  checks for an abort between slices);
* ``event``: a candidate tried in session 19 and not adopted (BENCHMARKS.md): one 10 ms slice,
  then asleep on an event that the work's future callback (or an abort) sets.

Why: on two busy cores a collective waits for a descheduled peer for tens of milliseconds, and
whatever a wait costs per millisecond of waiting becomes step time there.

Run: ``python benchmarks/wait_cost.py`` (~30 s); writes benchmarks/results/wait_cost.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as bl

MODES = ("blocking", "slices", "event")


def _wait(mode: str, work: Any) -> int:
    """Wait for ``work`` the ``mode`` way; return how many bounded waits timed out."""
    if mode == "blocking":
        work.wait()
        return 0
    if mode == "slices":
        timeouts = 0
        while True:
            try:
                work.wait(datetime.timedelta(milliseconds=10))
                return timeouts
            except Exception:
                timeouts += 1
                if work.is_completed():
                    return timeouts
    try:
        work.wait(datetime.timedelta(milliseconds=10))
    except Exception:
        if not work.is_completed():
            done = threading.Event()
            work.get_future().add_done_callback(lambda _: done.set())
            done.wait(60.0)
        return 1
    return 0


def _worker(rank: int, path: str, mode: str, rounds: int, late_s: float, q: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    t = torch.ones(1024)
    cpu, timeouts = [], 0
    for _ in range(rounds):
        dist.barrier()
        if rank == 1:
            time.sleep(late_s)
            dist.all_reduce(t)
            continue
        work = dist.all_reduce(t, async_op=True)
        c0 = time.process_time()
        timeouts += _wait(mode, work)
        cpu.append(time.process_time() - c0)
    if rank == 0:
        q.put({"mode": mode, "cpu_ms": statistics.fmean(cpu) * 1e3, "timeouts_per_wait": timeouts / rounds})
    dist.destroy_process_group()


def measure(mode: str, rounds: int, late_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="cl-wait-cost-") as d:
        path = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, path, mode, rounds, late_s, q)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        try:
            while True:
                try:
                    got: dict[str, Any] = q.get(timeout=1)
                    break
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                        codes = [p.exitcode for p in procs]
                        raise RuntimeError(f"wait_cost {mode}: a rank failed or hung ({codes})") from None
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--late-ms", type=float, default=100.0, help="how late the peer joins")
    ap.add_argument("--rounds", type=int, default=40, help="waits per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each mode, alternating")
    ap.add_argument("--out", default=str(bl.RESULTS / "wait_cost.json"))
    a = ap.parse_args(argv)
    runs = [measure(m, a.rounds, a.late_ms / 1000) for _ in range(a.repeats) for m in MODES]
    summary: dict[str, dict[str, Any]] = {}
    for m in MODES:
        mine = [r for r in runs if r["mode"] == m]
        summary[m] = {
            "cpu_ms_per_wait": statistics.median(r["cpu_ms"] for r in mine),
            "timeouts_per_wait": statistics.median(r["timeouts_per_wait"] for r in mine)
            if m != "blocking"
            else None,
        }
    res = {
        "benchmark": "wait_cost",
        "command": "python benchmarks/wait_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bl.machine_info(),
        "params": vars(a),
        "summary": summary,
        "runs": runs,
    }
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"peer late by {a.late_ms:g} ms; process CPU of the waiting rank per wait (median of {a.repeats}):")
    for m in MODES:
        s = summary[m]
        note = f"  ({s['timeouts_per_wait']:.1f} timed-out bounded waits)" if m != "blocking" else ""
        print(f"  {m:9s} {s['cpu_ms_per_wait']:6.3f} ms{note}")
    return res


if __name__ == "__main__":
    main()
